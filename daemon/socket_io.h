// Blocking socket I/O for the migration threads (the data path).
//
// libuv sets channels up (listen, accept, classify, connect); each data
// channel then belongs to one thread doing blocking read/writev on its own
// dup of the fd, the way QEMU's multifd threads own their QIOChannels. That
// keeps the hot path free of loop hand-offs and lets pages be read straight
// into the mapped image.
#pragma once

#include <memory>
#include <string>
#include <sys/types.h>
#include <sys/uio.h>
#include <vector>

#include "protocol/error.h"
#include "protocol/qemu_file.h"

namespace qmigd {

// Reads the main channel from a blocking fd; `prefix` holds bytes already
// taken off the socket during classification, delivered first. Errors name
// the main channel.
class FdInputStream : public InputStream {
public:
    FdInputStream(int fd, std::vector<uint8_t> prefix) : fd_(fd), prefix_(std::move(prefix)) {}
    ssize_t read_some(void *dst, size_t n, std::string *err) override;

private:
    int fd_;
    std::vector<uint8_t> prefix_;
    size_t prefix_pos_ = 0;
};

// Fills the whole iovec array (modifies it); EOF is an error.
Status readv_full(int fd, struct iovec *iov, int count);

// A multifd channel's receive side. It reads exactly what it is asked for:
// read-ahead into a buffer would save one system call per header-only
// packet, but it also pulls the page data that follows a header into the
// buffer, and copying that out again cost 7% of a receiver's CPU. One
// thread only.
class ChannelReader {
public:
    explicit ChannelReader(int fd) : fd_(fd) {}
    // Exactly n bytes. Returns 1, 0 on EOF before the first byte, or an
    // error (EOF in the middle is an error).
    Result<int> read(void *dst, size_t n);
    // Fills the whole iovec array (modifies it); EOF is an error.
    Status readv(struct iovec *iov, int count) { return readv_full(fd_, iov, count); }

private:
    int fd_;
};

// Writes the whole iovec array (modifies it). EINTR and partial writes handled.
Status writev_full(int fd, struct iovec *iov, int count);
Status write_full(int fd, const void *buf, size_t n);
// Wakes a thread blocked on fd (shutdown both directions); idempotent.
void shutdown_fd(int fd);
// Makes a dup of a libuv-owned socket that blocks, with TCP_NODELAY.
Result<int> take_blocking_fd(int uv_fd);
// Dead-link detection on a migration socket: a channel whose peer stops
// acknowledging (sent data, or keepalive probes while idle) for `ms` fails
// with ETIMEDOUT instead of waiting as long as the kernel retransmits
// (about 15 minutes, which is what QEMU 10 does). 0 leaves the defaults.
void set_link_timeout(int fd, unsigned ms);

} // namespace qmigd
