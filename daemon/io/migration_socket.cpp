// A migration channel's socket: blocking dups, a second connection to its peer, its options, the write guard.
#include "daemon/io/migration_socket.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

namespace qmigd {

namespace {

Error socket_errno_error(const char *what)
{
    return Error(std::string(what) + ": " + std::strerror(errno));
}

} // namespace

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

Result<UniqueFd> take_blocking_socket(int uv_fd)
{
    UniqueFd fd(fcntl(uv_fd, F_DUPFD_CLOEXEC, 0));
    if (!fd) {
        return socket_errno_error("dup of migration socket");
    }
    int flags = fcntl(fd.get(), F_GETFL);
    fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    if (is_tcp(fd.get())) {
        int one = 1;
        setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    return fd;
}

Result<UniqueFd> connect_to_peer(const UniqueFd &main, unsigned timeout_ms)
{
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    if (getpeername(main.get(), reinterpret_cast<sockaddr *>(&peer), &len) < 0) {
        return socket_errno_error("the main channel's peer");
    }
    UniqueFd s(socket(peer.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s) {
        return socket_errno_error("socket");
    }
    int rc = connect(s.get(), reinterpret_cast<sockaddr *>(&peer), len);
    if (rc < 0 && errno == EINPROGRESS) {
        pollfd p{s.get(), POLLOUT, 0};
        rc = poll(&p, 1, timeout_ms ? int(timeout_ms) : -1);
        int err = 0;
        socklen_t elen = sizeof(err);
        if (rc == 0) {
            err = ETIMEDOUT;
        } else if (rc > 0) {
            getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &elen);
        } else {
            err = errno;
        }
        errno = err;
        rc = err ? -1 : 0;
    }
    if (rc < 0) {
        return socket_errno_error("connect");
    }
    return take_blocking_socket(s.get());
}

size_t bytes_queued(int fd)
{
    int n = 0;
    return fd >= 0 && ioctl(fd, FIONREAD, &n) == 0 && n > 0 ? size_t(n) : 0;
}

Status PeerWriteGuard::begin(int fd, size_t n)
{
    {
        MutexLock lk(mu_);
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
    MutexLock lk(mu_);
    fd_ = -1;
}

void PeerWriteGuard::abort()
{
    MutexLock lk(mu_);
    aborted_ = true;
    if (fd_ >= 0) {
        ::shutdown(fd_, SHUT_WR);
    }
}

void PeerWriteGuard::reset()
{
    MutexLock lk(mu_);
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
