// MSG_ZEROCOPY sends for multifd sockets (QEMU's zero-copy-send, its
// QIO_CHANNEL_WRITE_FLAG_ZERO_COPY and qio_channel_flush()).
//
// The kernel sends the pages from where they are instead of copying them
// into the socket, and tells on the socket's error queue when it is done
// with each sendmsg(), and whether it had to copy after all (loopback and
// most virtual devices always do). Until then the memory must stay as it
// is, so pages go from the guest's memory itself (MultifdSend reads them
// there whatever the page path): a buffer the channel reuses would be
// overwritten under the kernel's feet.
//
// Thread ownership: one per channel, used by its thread only.
#pragma once

#include <cstdint>
#include <sys/uio.h>

#include "daemon/io/unique_fd.h"
#include "protocol/error.h"

namespace qmigd {

class ZeroCopySender {
public:
    // SO_ZEROCOPY on fd; QEMU's error when the kernel or socket cannot.
    static Status enable(const UniqueFd &fd);

    // Sends on fd, which its owner (the channel) keeps open while this lives.
    explicit ZeroCopySender(const UniqueFd &fd) : fd_(fd.get()) {}

    // Sends the whole iovec array (modified) with MSG_ZEROCOPY. The memory
    // must stay unchanged by us until flush() returned.
    Status writev(struct iovec *iov, int count);
    // Waits until the kernel finished every send so far. *all_copied: every
    // completion said it copied (QEMU counts those syncs in
    // dirty-sync-missed-zero-copy); false when nothing was pending.
    Status flush(bool *all_copied);

private:
    // Reads the completions queued so far; blocks for one when `wait`.
    Status reap(bool wait);

    int fd_; // the constructor's fd's number: a borrow
    uint64_t queued_ = 0; // sendmsg() calls made with MSG_ZEROCOPY
    uint64_t done_ = 0;   // of those, completed
    bool zero_copied_ = false; // since the last flush, some went without a copy
    bool reaped_ = false;      // since the last flush, completions arrived
};

} // namespace qmigd
