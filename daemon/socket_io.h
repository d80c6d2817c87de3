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

// The channel's socket itself (options, dups, the write guard), for the
// files that take both from this header.
#include "daemon/io/migration_socket.h"
#include "protocol/error.h"
#include "protocol/qemu_file.h"

namespace qmigd {

class Channel;
class TlsSession;

// Reads the main channel (blocking); `prefix` holds bytes already taken
// off the socket during classification, delivered first. Errors name the
// main channel.
class FdInputStream : public InputStream {
public:
    // `ch` is borrowed: its owner keeps it until this stream goes; this
    // thread is its reader (and its TLS session's).
    FdInputStream(Channel &ch, std::vector<uint8_t> prefix)
        : ch_(ch), prefix_(std::move(prefix))
    {
    }
    ssize_t read_some(void *dst, size_t n, std::string *err) override;
    // A file: the prefix is dropped and the fd repositioned.
    bool seek(uint64_t pos, std::string *err) override;

private:
    Channel &ch_;
    std::vector<uint8_t> prefix_;
    size_t prefix_pos_ = 0;
};

// A multifd channel's receive side: small reads (packet headers) come out
// of a buffer filled by reads of up to 16 KiB, so a run of header-only
// packets (zero pages) costs one system call and one wake-up per dozen
// headers, not one each; page data goes straight to its destination once
// the buffer is drained. The buffer stays small because what it reads
// ahead of a header is page data that must be copied out again (with
// 256 KiB that copy was 7% of a receiver's CPU). One thread only.
class ChannelReader {
public:
    // `ch` is borrowed: its owner keeps it until this reader goes.
    explicit ChannelReader(Channel &ch, size_t capacity = 16 * 1024)
        : ch_(ch), buf_(new uint8_t[capacity]), cap_(capacity)
    {
    }
    // Exactly n bytes. Returns 1, 0 on EOF before the first byte, or an
    // error (EOF in the middle is an error).
    Result<int> read(void *dst, size_t n);
    // Fills the whole iovec array (modifies it); EOF is an error.
    Status readv(struct iovec *iov, int count);

private:
    // Moves buffered bytes into the iovecs; returns how many were used up.
    void drain(struct iovec *&iov, int &count);

    Channel &ch_;
    std::unique_ptr<uint8_t[]> buf_;
    size_t cap_;
    size_t head_ = 0, tail_ = 0; // buffered bytes are buf_[head_, tail_)
};

// Fills the whole iovec array (modifies it); EOF is an error.
Status readv_full(int fd, struct iovec *iov, int count);
// Up to n bytes of a channel's stream, through its TLS session if it has
// one; 0 at the end of the stream.
Result<size_t> channel_read(int fd, TlsSession *tls, void *dst, size_t n);
// Fills the whole iovec array the same way; EOF is an error.
Status channel_readv(int fd, TlsSession *tls, struct iovec *iov, int count);
// The data channels' writes: through TLS when the channel has a session.
Status channel_writev(int fd, TlsSession *tls, struct iovec *iov, int count);
Status channel_write(int fd, TlsSession *tls, const void *buf, size_t n);
// Writes the whole iovec array (modifies it). EINTR and partial writes handled.
Status writev_full(int fd, struct iovec *iov, int count);
Status write_full(int fd, const void *buf, size_t n);
// The same at a file offset (migration files: mapped-ram pages and bitmaps).
Status pwritev_full(int fd, struct iovec *iov, int count, uint64_t offset);
Status pwrite_full(int fd, const void *buf, size_t n, uint64_t offset);
// Exactly n bytes from a file offset; the end of the file first is an error.
Status pread_full(int fd, void *buf, size_t n, uint64_t offset);
Status preadv_full(int fd, struct iovec *iov, int count, uint64_t offset);
// Advances an iovec array past n consumed bytes; returns the new start.
struct iovec *iov_advance(struct iovec *iov, int *count, size_t n);
// Adds [p, p + len) to iov[0..*n), growing the last iovec when p follows
// it (consecutive pages of a mapping go out as one).
inline void iov_append(struct iovec *iov, int *n, const void *p, size_t len)
{
    if (*n && static_cast<const uint8_t *>(iov[*n - 1].iov_base) + iov[*n - 1].iov_len == p) {
        iov[*n - 1].iov_len += len;
    } else {
        iov[(*n)++] = {const_cast<void *>(p), len};
    }
}
} // namespace qmigd
