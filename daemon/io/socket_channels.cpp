// Listening for migration channels: accept, read each connection's first bytes, hand it over.
#include "daemon/io/socket_channels.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/io/migration_socket.h"

namespace qmigd {

namespace {

// A listen address, as QEMU's inet_listen_saddr() resolves it: the first
// of getaddrinfo()'s answers. An empty host is QEMU's "tcp::PORT": every
// interface. `numeric`: no lookup, so that the caller may block on it
// (EAI_NONAME: a name, to be resolved off the loop).
struct ListenAddress {
    int rc = 0; // getaddrinfo()'s
    sockaddr_storage ss{};
};
ListenAddress resolve_listen(const SocketAddress &addr, bool numeric)
{
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | (numeric ? AI_NUMERICHOST : 0);
    addrinfo *res = nullptr;
    std::string port = std::to_string(addr.port);
    ListenAddress out;
    out.rc = getaddrinfo(addr.host.empty() ? nullptr : addr.host.c_str(), port.c_str(), &hints,
                         &res);
    if (out.rc == 0 && res) {
        std::memcpy(&out.ss, res->ai_addr, std::min<size_t>(res->ai_addrlen, sizeof(out.ss)));
    } else if (out.rc == 0) {
        out.rc = EAI_NONAME;
    }
    if (res) {
        freeaddrinfo(res);
    }
    return out;
}

Error resolution_error(const SocketAddress &addr, int rc)
{
    return Error(fmt::format("address resolution failed for {}:{}: {}", addr.host, addr.port,
                             gai_strerror(rc)));
}

// Sets *fd to a bound unix stream socket (close-on-exec, non-blocking);
// 0, or -errno.
int unix_listen_fd(const std::string &path, UniqueFd *fd)
{
    UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s) {
        return -errno;
    }
    sockaddr_un un{};
    un.sun_family = AF_UNIX;
    std::memcpy(un.sun_path, path.c_str(), path.size()); // length checked by the caller
    if (::bind(s.get(), reinterpret_cast<sockaddr *>(&un), sizeof(un)) < 0) {
        return -errno;
    }
    *fd = std::move(s);
    return 0;
}

} // namespace

Status resolve_listen_host(SocketAddress *addr)
{
    if (addr->type != SocketAddress::Type::Inet || addr->host.empty()) {
        return {};
    }
    ListenAddress r = resolve_listen(*addr, false);
    char host[NI_MAXHOST];
    if (r.rc == 0) {
        r.rc = getnameinfo(reinterpret_cast<const sockaddr *>(&r.ss), sizeof(r.ss), host,
                           sizeof host, nullptr, 0, NI_NUMERICHOST);
    }
    if (r.rc != 0) {
        return resolution_error(*addr, r.rc);
    }
    addr->host = host;
    return {};
}

void DroppedStrangers::log(const char *what, const char *rule, const ListenerLimits &limits)
{
    if (evicted || expired) {
        spdlog::warn("incoming migration: closed {} {} that did not identify themselves within "
                     "{} ms and {} over the limit of {} ({}); still listening",
                     expired, what, limits.identify_ms, evicted, limits.max_pending, rule);
        evicted = expired = 0;
    }
    if (gone) {
        spdlog::info("incoming migration: {} {} ended before they identified themselves; still "
                     "listening",
                     gone, what);
        gone = 0;
    }
}

void RateLimitedLog::warn(uint64_t now_ms, const std::string &line)
{
    if (said_ && now_ms - said_ms_ < 1000) {
        quiet_++;
        return;
    }
    spdlog::warn("{}{}", line,
                 quiet_ ? fmt::format(" ({} more since the last such line)", quiet_) : "");
    said_ = true;
    said_ms_ = now_ms;
    quiet_ = 0;
}

uv_timer_t *sweeper_start(uv_loop_t *loop, const ListenerLimits &limits, void *data,
                          uv_timer_cb cb)
{
    auto *t = new uv_timer_t;
    uv_timer_init(loop, t);
    t->data = data;
    uint64_t every = std::max<uint64_t>(limits.identify_ms / 4, 50);
    uv_timer_start(t, cb, every, every);
    return t;
}

void sweeper_close(uv_timer_t **t)
{
    uv_close(reinterpret_cast<uv_handle_t *>(*t),
             [](uv_handle_t *h) { delete reinterpret_cast<uv_timer_t *>(h); });
    *t = nullptr;
}

SocketListener::~SocketListener() { close(); }

Status SocketListener::listen(const SocketAddress &addr, OnListening on_listening)
{
    addr_ = addr;
    sweeper_ = sweeper_start(loop_, limits_, this, [](uv_timer_t *t) {
        static_cast<SocketListener *>(t->data)->sweep();
    });
    if (addr.type == SocketAddress::Type::Unix) {
        QMIGD_TRY(check_unix_path(addr.path));
    }
    server_ = new StreamHandle;
    server_->init(loop_, addr.type, this);
    if (addr.type == SocketAddress::Type::Unix) {
        // QEMU's unix_listen_saddr: a stale socket file is replaced.
        if (::unlink(addr.path.c_str()) < 0 && errno != ENOENT) {
            int err = errno;
            close();
            return Error(fmt::format("Failed to unlink socket {}: {}", addr.path,
                                     std::strerror(err)));
        }
        // Bound here, not with uv_pipe_bind(): libuv reports a missing
        // directory as EACCES, and QEMU's text carries the real errno.
        UniqueFd fd;
        int rc = unix_listen_fd(addr.path, &fd);
        if (rc == 0) {
            rc = uv_pipe_open(&server_->pipe, fd.get());
        }
        if (rc == 0) {
            fd.release(); // the pipe handle owns it now
            rc = uv_listen(server_->stream(), 64, on_connection);
        }
        if (rc != 0) {
            close();
            return Error(fmt::format("Failed to bind socket to {}: {}", addr.path,
                                     std::strerror(-rc)));
        }
        return {};
    }
    ListenAddress numeric = resolve_listen(addr, true);
    if (numeric.rc == 0) {
        return bind_and_listen(reinterpret_cast<const sockaddr *>(&numeric.ss));
    }
    if (numeric.rc != EAI_NONAME || addr.host.empty()) {
        close();
        return resolution_error(addr, numeric.rc);
    }
    on_listening_ = std::move(on_listening);
    lookup_ = NameLookup::start(loop_, addr.host, std::to_string(addr.port), AI_PASSIVE,
                                [this](int rc, const std::vector<sockaddr_storage> &addrs) {
                                    resolved(rc, addrs);
                                });
    if (!lookup_) {
        close();
        return Error(fmt::format("address resolution failed for {}:{}: {}", addr.host, addr.port,
                                 NameLookup::too_many()));
    }
    return {};
}

// The name's lookup ended: listen on its first answer, as QEMU's
// inet_listen_saddr() takes it.
void SocketListener::resolved(int rc, const std::vector<sockaddr_storage> &addrs)
{
    lookup_.reset();
    Status st;
    if (rc != 0 || addrs.empty()) {
        st = resolution_error(addr_, rc != 0 ? rc : EAI_NONAME);
        close();
    } else {
        // Reported as QEMU reports a listener: by its numeric address.
        char host[NI_MAXHOST];
        if (getnameinfo(reinterpret_cast<const sockaddr *>(&addrs[0]), sizeof(addrs[0]), host,
                        sizeof host, nullptr, 0, NI_NUMERICHOST) == 0) {
            addr_.host = host;
        }
        st = bind_and_listen(reinterpret_cast<const sockaddr *>(&addrs[0]));
    }
    // Last: the callback may destroy the listener.
    OnListening cb = std::move(on_listening_);
    if (cb) {
        cb(st);
    }
}

// Binds the TCP server handle to `sa` and listens; closes on failure.
Status SocketListener::bind_and_listen(const sockaddr *sa)
{
    int rc = uv_tcp_bind(&server_->tcp, sa, 0);
    if (rc == 0) {
        rc = uv_listen(server_->stream(), 64, on_connection);
    }
    if (rc != 0) {
        close();
        return Error(fmt::format("Failed to bind socket for {}:{}: {}", addr_.host, addr_.port,
                                 uv_strerror(rc)));
    }
    sockaddr_storage bound{};
    int len = sizeof(bound);
    uv_tcp_getsockname(&server_->tcp, reinterpret_cast<sockaddr *>(&bound), &len);
    addr_.port = ntohs(bound.ss_family == AF_INET6
                           ? reinterpret_cast<sockaddr_in6 *>(&bound)->sin6_port
                           : reinterpret_cast<sockaddr_in *>(&bound)->sin_port);
    return {};
}

void SocketListener::on_connection(uv_stream_t *server, int status)
{
    auto *self = static_cast<SocketListener *>(server->data);
    if (status < 0) {
        return;
    }
    if (self->pending_.size() >= self->limits_.max_pending) {
        self->evict_one();
    }
    auto *c = new PendingConnection;
    c->owner_ = self;
    c->want(self->first_want_);
    c->accepted_ms_ = c->heard_ms_ = uv_now(self->loop_);
    c->h_.init(self->loop_, self->addr_.type, c);
    if (uv_accept(server, c->h_.stream()) != 0) {
        c->owner_ = nullptr;
        c->close();
        return;
    }
    self->pending_.push_back(c);
    if (self->on_accept_ && self->on_accept_(c)) {
        return;
    }
    self->start_reading(c);
}

// Which stranger a newcomer ends: of those that sent some bytes and
// stopped, the one heard from longest ago; only when none has sent any, the
// oldest of those that sent nothing. A source sends its first bytes in one
// write, but not always at once: its multifd channels wait for the main
// channel's TLS handshake, which a flood slows down. Bytes that stopped are
// a surer sign of a stall than none yet, so a flood of stalled prefixes
// never ends a channel that has not spoken (its deadline still does), as
// long as the loop reads the flood's bytes as fast as they come (bytes not
// read yet count as none).
void SocketListener::evict_one()
{
    auto quietest = std::min_element(pending_.begin(), pending_.end(),
                                     [](const PendingConnection *a, const PendingConnection *b) {
                                         bool a_silent = a->have_ == 0, b_silent = b->have_ == 0;
                                         if (a_silent != b_silent) {
                                             return b_silent;
                                         }
                                         return a->heard_ms_ < b->heard_ms_;
                                     });
    if (quietest != pending_.end()) {
        dropped_.evicted++;
        (*quietest)->close();
    }
}

void SocketListener::sweep()
{
    uint64_t now = uv_now(loop_);
    std::vector<PendingConnection *> late;
    for (PendingConnection *c : pending_) {
        if (now - c->accepted_ms_ >= limits_.identify_ms) {
            late.push_back(c);
        }
    }
    dropped_.expired += late.size();
    for (PendingConnection *c : late) {
        c->close();
    }
    dropped_.log("connections", "the stalled went first", limits_);
}

void SocketListener::start_reading(PendingConnection *c)
{
    // The read buffer is exactly the bytes still wanted, so libuv never
    // takes bytes past the prefix off the socket.
    uv_read_start(
        c->h_.stream(),
        [](uv_handle_t *h, size_t, uv_buf_t *buf) {
            auto *pc = static_cast<PendingConnection *>(h->data);
            *buf = uv_buf_init(reinterpret_cast<char *>(pc->buf_.data() + pc->have_),
                               unsigned(pc->want_ - pc->have_));
        },
        [](uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
            auto *pc = static_cast<PendingConnection *>(s->data);
            SocketListener *self = pc->owner_;
            if (nread < 0) {
                // A port probe, a reset, a partial header: or a source that
                // connected and gave up (its own error says why). QEMU 10
                // fails the incoming migration here; a stranger must not.
                spdlog::debug("incoming connection ended after {} bytes, before it identified "
                              "itself: {}",
                              pc->have_, uv_strerror(int(nread)));
                if (self) {
                    self->dropped_.gone++;
                }
                pc->close();
                return;
            }
            if (nread == 0) {
                return;
            }
            (void)buf; // points into pc->buf_
            pc->heard_ms_ = uv_now(pc->h_.handle()->loop);
            pc->have_ += size_t(nread);
            if (pc->have_ < pc->want_) {
                return;
            }
            size_t before = pc->want_;
            self->on_prefix_(pc);
            if (!pc->done_ && pc->want_ == before) {
                pc->close(); // the callback neither kept nor extended it
            }
        });
}

void SocketListener::release(PendingConnection *c)
{
    pending_.erase(std::remove(pending_.begin(), pending_.end(), c), pending_.end());
}

Result<UniqueFd> PendingConnection::take_socket()
{
    uv_os_fd_t ufd;
    uv_fileno(h_.handle(), &ufd);
    uv_read_stop(h_.stream());
    auto fd = take_blocking_socket(ufd);
    close();
    return fd;
}

void PendingConnection::close()
{
    if (done_) {
        return;
    }
    done_ = true;
    if (owner_) {
        owner_->release(this);
    }
    uv_close(h_.handle(),
             [](uv_handle_t *h) { delete static_cast<PendingConnection *>(h->data); });
}

void SocketListener::close()
{
    if (lookup_) {
        lookup_.reset(); // its thread's answer is dropped
        on_listening_ = nullptr;
    }
    while (!pending_.empty()) {
        pending_.back()->close();
    }
    if (sweeper_) {
        dropped_.log("connections", "the stalled went first", limits_);
        sweeper_close(&sweeper_);
    }
    if (server_) {
        uv_close(server_->handle(),
                 [](uv_handle_t *h) { delete reinterpret_cast<StreamHandle *>(h); });
        server_ = nullptr;
        if (addr_.type == SocketAddress::Type::Unix) {
            ::unlink(addr_.path.c_str()); // QEMU's socket_listen_cleanup
        }
    }
}

} // namespace qmigd
