#include "daemon/socket_io.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/tls/tls_session.h"

namespace qmigd {

namespace {

Error errno_error(const char *what) { return Error(std::string(what) + ": " + std::strerror(errno)); }

} // namespace

struct iovec *iov_advance(struct iovec *iov, int *count, size_t n)
{
    while (*count > 0 && n >= iov->iov_len) {
        n -= iov->iov_len;
        iov++;
        (*count)--;
    }
    if (*count > 0) {
        iov->iov_base = static_cast<uint8_t *>(iov->iov_base) + n;
        iov->iov_len -= n;
    }
    return iov;
}

ssize_t FdInputStream::read_some(void *dst, size_t n, std::string *err)
{
    if (prefix_pos_ < prefix_.size()) {
        size_t k = std::min(n, prefix_.size() - prefix_pos_);
        std::memcpy(dst, prefix_.data() + prefix_pos_, k);
        prefix_pos_ += k;
        return ssize_t(k);
    }
    auto r = channel_read(fd_, tls_, dst, n);
    if (!r) {
        *err = "main channel: " + r.error().message();
        return -1;
    }
    return ssize_t(*r);
}

Result<size_t> channel_read(int fd, TlsSession *tls, void *dst, size_t n)
{
    if (tls) {
        return tls->read(dst, n);
    }
    for (;;) {
        ssize_t r = ::read(fd, dst, n);
        if (r >= 0) {
            return size_t(r);
        }
        if (errno != EINTR) {
            return errno_error("read from migration channel");
        }
    }
}

// Reads until the iovecs are full: `op` reads some bytes into them and
// returns how many (0: the end of the stream, an error here).
template <typename Op>
static Status read_all(struct iovec *iov, int count, Op op)
{
    while (count > 0) {
        auto r = op(iov, count);
        QMIGD_TRY(r);
        if (*r == 0) {
            return Error("unexpected end of stream in the middle of a packet");
        }
        iov = iov_advance(iov, &count, *r);
    }
    return {};
}

Status readv_full(int fd, struct iovec *iov, int count)
{
    return read_all(iov, count, [fd](struct iovec *v, int n) -> Result<size_t> {
        for (;;) {
            ssize_t r = ::readv(fd, v, std::min(n, IOV_MAX));
            if (r >= 0) {
                return size_t(r);
            }
            if (errno != EINTR) {
                return errno_error("read from migration channel");
            }
        }
    });
}

Status channel_readv(int fd, TlsSession *tls, struct iovec *iov, int count)
{
    if (!tls) {
        return readv_full(fd, iov, count);
    }
    return read_all(iov, count,
                    [tls](struct iovec *v, int) { return tls->read(v->iov_base, v->iov_len); });
}

void ChannelReader::drain(struct iovec *&iov, int &count)
{
    while (count > 0 && head_ < tail_) {
        size_t k = std::min(iov->iov_len, tail_ - head_);
        std::memcpy(iov->iov_base, buf_.get() + head_, k);
        head_ += k;
        iov = iov_advance(iov, &count, k);
    }
}

Result<int> ChannelReader::read(void *dst, size_t n)
{
    struct iovec one = {dst, n};
    struct iovec *iov = &one;
    int count = 1;
    bool got_any = head_ < tail_;
    drain(iov, count);
    while (count > 0) {
        if (iov->iov_len >= cap_ / 2) {
            QMIGD_TRY(readv(iov, count)); // large: no point in buffering
            return 1;
        }
        auto got = channel_read(fd_, tls_, buf_.get(), cap_);
        QMIGD_TRY(got);
        size_t r = *got;
        if (r == 0) {
            if (!got_any && iov->iov_len == n) {
                return 0;
            }
            return Error("unexpected end of stream in the middle of a packet");
        }
        got_any = true;
        head_ = 0;
        tail_ = r;
        drain(iov, count);
    }
    return 1;
}

Status ChannelReader::readv(struct iovec *iov, int count)
{
    drain(iov, count);
    return channel_readv(fd_, tls_, iov, count);
}

Status channel_writev(int fd, TlsSession *tls, struct iovec *iov, int count)
{
    return tls ? tls->writev(iov, count) : writev_full(fd, iov, count);
}

Status channel_write(int fd, TlsSession *tls, const void *buf, size_t n)
{
    return tls ? tls->write(buf, n) : write_full(fd, buf, n);
}

Status writev_full(int fd, struct iovec *iov, int count)
{
    while (count > 0) {
        ssize_t r = ::writev(fd, iov, std::min(count, IOV_MAX));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            return errno_error("write to migration channel");
        }
        iov = iov_advance(iov, &count, size_t(r));
    }
    return {};
}

Status write_full(int fd, const void *buf, size_t n)
{
    struct iovec iov = {const_cast<void *>(buf), n};
    return writev_full(fd, &iov, 1);
}

bool FdInputStream::seek(uint64_t pos, std::string *err)
{
    if (::lseek(fd_, off_t(pos), SEEK_SET) < 0) {
        *err = fmt::format("Unable to seek to offset {} whence {} in file: {}", pos, SEEK_SET,
                           std::strerror(errno));
        return false;
    }
    prefix_pos_ = prefix_.size();
    return true;
}

// pwritev/preadv until the iovecs are done: EINTR retried, short transfers
// continued; `what` names the direction in the error.
template <typename Op>
static Status positioned_io(int fd, struct iovec *iov, int count, uint64_t offset, Op op,
                            const char *what, const char *at_zero)
{
    while (count > 0) {
        ssize_t r = op(fd, iov, std::min(count, IOV_MAX), off_t(offset));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return Error(fmt::format("Unable to {} file at offset 0x{:x}: {}", what, offset,
                                     r < 0 ? std::strerror(errno) : at_zero));
        }
        offset += uint64_t(r);
        iov = iov_advance(iov, &count, size_t(r));
    }
    return {};
}

Status pwritev_full(int fd, struct iovec *iov, int count, uint64_t offset)
{
    return positioned_io(fd, iov, count, offset, ::pwritev, "write to", "no progress");
}

Status pwrite_full(int fd, const void *buf, size_t n, uint64_t offset)
{
    struct iovec iov = {const_cast<void *>(buf), n};
    return pwritev_full(fd, &iov, 1, offset);
}

Status preadv_full(int fd, struct iovec *iov, int count, uint64_t offset)
{
    return positioned_io(fd, iov, count, offset, ::preadv, "read from", "unexpected end of file");
}

Status pread_full(int fd, void *buf, size_t n, uint64_t offset)
{
    struct iovec iov = {buf, n};
    return preadv_full(fd, &iov, 1, offset);
}

void shutdown_fd(int fd)
{
    if (fd >= 0) {
        ::shutdown(fd, SHUT_RDWR);
    }
}

namespace {

bool is_tcp(int fd)
{
    int domain = 0;
    socklen_t len = sizeof(domain);
    return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 &&
           (domain == AF_INET || domain == AF_INET6);
}

} // namespace

void set_link_timeout(int fd, unsigned ms)
{
    if (ms == 0 || !is_tcp(fd)) {
        return; // a unix socket's peer is on this host: its death is an EOF
    }
    // Probes start after a third of the timeout idle, every sixth; the
    // user timeout then bounds both unacknowledged data and probes.
    int one = 1;
    int idle = std::max(1u, ms / 3000), intvl = std::max(1u, ms / 6000), cnt = 6;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
}

bool peer_is_local(int fd)
{
    sockaddr_storage peer{}, self{};
    socklen_t plen = sizeof(peer), slen = sizeof(self);
    if (!is_tcp(fd) || getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &plen) < 0 ||
        getsockname(fd, reinterpret_cast<sockaddr *>(&self), &slen) < 0) {
        return false;
    }
    if (peer.ss_family == AF_INET) {
        auto &p = reinterpret_cast<const sockaddr_in &>(peer);
        auto &s = reinterpret_cast<const sockaddr_in &>(self);
        return (ntohl(p.sin_addr.s_addr) >> 24) == 127 || p.sin_addr.s_addr == s.sin_addr.s_addr;
    }
    auto &p = reinterpret_cast<const sockaddr_in6 &>(peer);
    auto &s = reinterpret_cast<const sockaddr_in6 &>(self);
    const uint8_t *a = p.sin6_addr.s6_addr;
    bool v4_loopback = IN6_IS_ADDR_V4MAPPED(&p.sin6_addr) && a[12] == 127;
    return IN6_IS_ADDR_LOOPBACK(&p.sin6_addr) || v4_loopback ||
           std::memcmp(&p.sin6_addr, &s.sin6_addr, sizeof(in6_addr)) == 0;
}

void set_send_buffer(int fd, unsigned bytes)
{
    int v = int(std::min<unsigned>(bytes, INT32_MAX / 2));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof(v));
}

Result<int> take_blocking_fd(int uv_fd)
{
    int fd = fcntl(uv_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
        return errno_error("dup of migration socket");
    }
    int flags = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    if (is_tcp(fd)) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    return fd;
}

Result<int> connect_to_peer_of(int fd, unsigned timeout_ms)
{
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    if (getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &len) < 0) {
        return errno_error("the main channel's peer");
    }
    int s = socket(peer.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) {
        return errno_error("socket");
    }
    int rc = connect(s, reinterpret_cast<sockaddr *>(&peer), len);
    if (rc < 0 && errno == EINPROGRESS) {
        pollfd p{s, POLLOUT, 0};
        rc = poll(&p, 1, timeout_ms ? int(timeout_ms) : -1);
        int err = 0;
        socklen_t elen = sizeof(err);
        if (rc == 0) {
            err = ETIMEDOUT;
        } else if (rc > 0) {
            getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &elen);
        } else {
            err = errno;
        }
        errno = err;
        rc = err ? -1 : 0;
    }
    if (rc < 0) {
        Error e = errno_error("connect");
        ::close(s);
        return e;
    }
    auto blocking = take_blocking_fd(s);
    ::close(s);
    return blocking;
}

size_t bytes_queued(int fd)
{
    int n = 0;
    return fd >= 0 && ioctl(fd, FIONREAD, &n) == 0 && n > 0 ? size_t(n) : 0;
}

Status PeerWriteGuard::begin(int fd, size_t n)
{
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (!aborted_) {
            fd_ = fd; // Pairs with abort(): from here on it shuts us out
            return {};
        }
    }
    if (n > kAbortedWriteMax) {
        return Error("the migration is ending: nothing more goes to the peer");
    }
    pollfd p{fd, POLLOUT, 0};
    int rc;
    do {
        rc = poll(&p, 1, kAbortedWriteWaitMs);
    } while (rc < 0 && errno == EINTR);
    if (rc <= 0 || !(p.revents & POLLOUT) || (p.revents & (POLLERR | POLLHUP))) {
        return Error("the peer does not read what is sent to it: write abandoned");
    }
    return {}; // room for n bytes: the write cannot block
}

void PeerWriteGuard::end()
{
    std::lock_guard<std::mutex> lk(mu_);
    fd_ = -1;
}

void PeerWriteGuard::abort()
{
    std::lock_guard<std::mutex> lk(mu_);
    aborted_ = true;
    if (fd_ >= 0) {
        ::shutdown(fd_, SHUT_WR);
    }
}

void PeerWriteGuard::reset()
{
    std::lock_guard<std::mutex> lk(mu_);
    fd_ = -1;
    aborted_ = false;
}

Status return_path_check(int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
        return Error("the return path needs a socket (tcp:, unix:, or fd: of a socket)");
    }
    return {};
}

} // namespace qmigd
