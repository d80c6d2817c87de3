// Blocking socket I/O for the migration threads (the data path).
//
// libuv sets channels up (listen, accept, classify, connect); each data
// channel then belongs to one thread doing blocking read/writev on its own
// dup of the fd, the way QEMU's multifd threads own their QIOChannels. That
// keeps the hot path free of loop hand-offs and lets pages be read straight
// into the mapped image.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <sys/types.h>
#include <sys/uio.h>
#include <vector>

#include "protocol/error.h"
#include "protocol/qemu_file.h"

namespace qmigd {

class TlsSession;

// Reads the main channel from a blocking fd; `prefix` holds bytes already
// taken off the socket during classification, delivered first. Errors name
// the main channel.
class FdInputStream : public InputStream {
public:
    // `tls`: the channel's TLS session (may be null), used by this thread.
    FdInputStream(int fd, std::vector<uint8_t> prefix, TlsSession *tls = nullptr)
        : fd_(fd), prefix_(std::move(prefix)), tls_(tls)
    {
    }
    ssize_t read_some(void *dst, size_t n, std::string *err) override;
    // A file: the prefix is dropped and the fd repositioned.
    bool seek(uint64_t pos, std::string *err) override;

private:
    int fd_;
    std::vector<uint8_t> prefix_;
    size_t prefix_pos_ = 0;
    TlsSession *tls_;
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
    explicit ChannelReader(int fd, TlsSession *tls = nullptr, size_t capacity = 16 * 1024)
        : fd_(fd), tls_(tls), buf_(new uint8_t[capacity]), cap_(capacity)
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

    int fd_;
    TlsSession *tls_;
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
// A blocking write to a peer that cancel and quit can always end: a peer
// that stops reading would otherwise hold the writer in send() for ever,
// and whoever joins the writer with it. The writer brackets each write
// with begin()/end(); abort(), from any thread, shuts the write side of
// the socket being written at that moment. After abort() only a small
// write goes, and only once the socket has room for it within
// kAbortedWriteWaitMs: a verdict (the return path's SHUT) still reaches a
// peer that reads, and never waits on one that does not.
//
// Thread ownership: fd_ and aborted_ are protected by mu_; the writer is
// one thread at a time.
class PeerWriteGuard {
public:
    static constexpr int kAbortedWriteWaitMs = 500;
    static constexpr size_t kAbortedWriteMax = 4096;

    // Writer: before writing n bytes on fd; an error instead of a write
    // that could block once aborted.
    Status begin(int fd, size_t n);
    // Writer: the write returned.
    void end();
    // Any thread: ends the write in progress and bounds the later ones.
    void abort();
    // Before a new migration's writer starts.
    void reset();

private:
    std::mutex mu_;
    int fd_ = -1;         // being written; protected by mu_
    bool aborted_ = false; // protected by mu_
};

// Bytes that came on a socket and are not read yet (0 on an error).
size_t bytes_queued(int fd);
// Wakes a thread blocked on fd (shutdown both directions); idempotent.
void shutdown_fd(int fd);

// The return path is the main channel's socket read the other way: a file
// or a pipe has none. QEMU's qemu_file_get_return_path() needs a socket too.
Status return_path_check(int fd);
// Makes a dup of a libuv-owned socket that blocks, with TCP_NODELAY.
Result<int> take_blocking_fd(int uv_fd);
// A new connection to where fd is connected (postcopy's preempt channel
// goes to the main channel's address), blocking and with TCP_NODELAY;
// fails after timeout_ms (0: as long as the kernel tries).
Result<int> connect_to_peer_of(int fd, unsigned timeout_ms);
// Dead-link detection on a migration socket: a channel whose peer stops
// acknowledging (sent data, or keepalive probes while idle) for `ms` fails
// with ETIMEDOUT instead of waiting as long as the kernel retransmits
// (about 15 minutes, which is what QEMU 10 does). 0 leaves the defaults.
void set_link_timeout(int fd, unsigned ms);
// True for a TCP socket whose peer is on this host (a loopback address, or
// the socket's own local address).
bool peer_is_local(int fd);
// Caps a socket's send buffer at `bytes` (SO_SNDBUF; the kernel doubles it
// for its bookkeeping). Why, for a peer on this host: with the default
// autotuning (up to 4 MiB a socket) the pages a sender copies into the
// socket are out of the cache by the time the receiver copies them out;
// with a few hundred KiB in flight they are still there. A bare 4-stream
// copy of 2 GiB between hugetlbfs mappings: one page in three 0.42 -> 0.31 s,
// every page 0.58 -> 0.40 s, alike from 64 KiB to 512 KiB (the receive
// buffer's size made no difference). qmigd -> qmigd, 2 GiB, 4 channels,
// 128 KiB: hugetlbfs mixed 0.41 -> 0.31 s, random 0.56 -> 0.53 s; huge-page
// tmpfs mixed 0.58 -> 0.30 s; /dev/shm mixed 0.78 -> 0.64 s; 32 KiB was
// slower than any. Across a network a capped window would cap throughput
// at buffer / round trip, so only a local peer gets it.
void set_send_buffer(int fd, unsigned bytes);

} // namespace qmigd
