// Channel: one migration channel, as QEMU's QIOChannel: its descriptor, its
// TLS session once the handshake is done, and a shutdown any thread may call.
//
// Both roles use it for every channel a migration thread reads or writes
// (main, multifd, preempt, the return path's direction of the main one).
//
// Thread ownership: the Channel's owner (the object that runs the
// migration) creates it and destroys it only after joining every thread
// that uses it; its TLS session is set by the one thread that uses the
// channel at that moment, before any other does (the migration thread for
// the main channel, each multifd sender for its own after its handshake).
// The descriptor therefore stays valid, and its number taken, for as long
// as any thread can touch it. Data calls: one reading thread and one writing
// thread at a time (GnuTLS allows one send and one receive in parallel on
// a session: the return path reads the main channel's socket while the
// migration thread writes it). shutdown(): any thread, any time while the
// Channel lives; it is how cancel, quit and a failure wake a blocked thread.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <memory>

#include "daemon/io/unique_fd.h"
#include "protocol/error.h"

namespace qmigd {

class TlsSession;

class Channel {
public:
    explicit Channel(UniqueFd fd);
    Channel(UniqueFd fd, std::unique_ptr<TlsSession> tls);
    ~Channel();
    Channel(const Channel &) = delete;
    Channel &operator=(const Channel &) = delete;

    // Borrowed: valid while the Channel lives. fd() for a system call on
    // it, descriptor() for an object that keeps using it (a TLS session,
    // a zero-copy sender, a second connection to its peer).
    int fd() const { return fd_.get(); }
    const UniqueFd &descriptor() const { return fd_; }
    TlsSession *tls() const { return tls_.get(); }
    // By the channel's only user at that moment, before a second thread
    // (the return path's reader, a shutdown) reads tls().
    void set_tls(std::unique_ptr<TlsSession> tls);

    // Up to n bytes; 0 at the end of the stream.
    Result<size_t> read_some(void *dst, size_t n);
    // Exactly n bytes; the end of the stream first is an error.
    Status read_full(void *dst, size_t n);
    // Fills the whole iovec array (modifies it); EOF is an error.
    Status readv(struct iovec *iov, int count);
    // Writes everything (the iovec array is modified).
    Status write(const void *buf, size_t n);
    Status writev(struct iovec *iov, int count);

    // Any thread: wakes whoever is blocked on the channel (their calls
    // fail) and makes later calls fail at once. The descriptor stays open
    // until the Channel is destroyed. Idempotent.
    void shutdown();

private:
    UniqueFd fd_;
    std::unique_ptr<TlsSession> tls_;
};

} // namespace qmigd
