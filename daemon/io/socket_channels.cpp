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

#include "daemon/socket_io.h"

namespace qmigd {

void StreamHandle::init(uv_loop_t *loop, SocketAddress::Type type, void *data)
{
    if (type == SocketAddress::Type::Unix) {
        uv_pipe_init(loop, &pipe, 0);
    } else {
        uv_tcp_init(loop, &tcp);
    }
    handle()->data = data;
}

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

// A bound unix stream socket (close-on-exec, non-blocking), or -errno.
int unix_listen_fd(const std::string &path)
{
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        return -errno;
    }
    sockaddr_un un{};
    un.sun_family = AF_UNIX;
    std::memcpy(un.sun_path, path.c_str(), path.size()); // length checked by the caller
    if (::bind(fd, reinterpret_cast<sockaddr *>(&un), sizeof(un)) < 0) {
        int err = errno;
        ::close(fd);
        return -err;
    }
    return fd;
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
        int fd = unix_listen_fd(addr.path);
        int rc = fd < 0 ? fd : uv_pipe_open(&server_->pipe, fd);
        if (rc == 0) {
            rc = uv_listen(server_->stream(), 64, on_connection);
        } else if (fd >= 0) {
            ::close(fd);
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

void SocketListener::evict_one()
{
    auto quietest = std::min_element(pending_.begin(), pending_.end(),
                                     [](const PendingConnection *a, const PendingConnection *b) {
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
    dropped_.log("connections", "the longest silent went", limits_);
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
            if (nread == UV_EOF && pc->have_ == 0) {
                // Nothing sent at all: a port probe, or a source that
                // connected its channels and gave up before using them
                // (its own error says why). It costs the migration nothing,
                // so it does not end it.
                spdlog::info("incoming connection closed before sending anything: ignored");
                pc->close();
                return;
            }
            if (nread < 0) {
                Error e(nread == UV_EOF
                            ? "incoming connection closed before it identified itself"
                            : std::string("incoming connection: ") + uv_strerror(int(nread)));
                pc->close();
                if (self) {
                    self->on_prefix_(nullptr, &e);
                }
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
            self->on_prefix_(pc, nullptr);
            if (!pc->done_ && pc->want_ == before) {
                pc->close(); // the callback neither kept nor extended it
            }
        });
}

void SocketListener::release(PendingConnection *c)
{
    pending_.erase(std::remove(pending_.begin(), pending_.end(), c), pending_.end());
}

Result<int> PendingConnection::take()
{
    uv_os_fd_t ufd;
    uv_fileno(h_.handle(), &ufd);
    uv_read_stop(h_.stream());
    auto fd = take_blocking_fd(ufd);
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
        dropped_.log("connections", "the longest silent went", limits_);
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

struct SocketConnect::Attempt {
    uv_connect_t req;
    StreamHandle h;
    std::shared_ptr<SocketConnect> owner; // keeps it alive until closed
    size_t index = 0;
};

std::shared_ptr<SocketConnect> SocketConnect::start(uv_loop_t *loop, const SocketAddress &addr,
                                                    unsigned count, Done done)
{
    std::shared_ptr<SocketConnect> c(new SocketConnect(loop, addr, count, std::move(done)));
    if (addr.type == SocketAddress::Type::Unix) {
        if (auto st = check_unix_path(addr.path); !st) {
            c->finish(st.error());
            return c;
        }
        c->addrs_.emplace_back(); // the path is the address
        c->try_address(0);
        return c;
    }
    // The lookup holds a reference until it answers or is cancelled.
    c->lookup_ = NameLookup::start(loop, addr.host, std::to_string(addr.port), 0,
                                   [c](int rc, const std::vector<sockaddr_storage> &addrs) {
                                       c->resolved(rc, addrs);
                                   });
    if (!c->lookup_) {
        c->finish(Error(fmt::format("address resolution failed for {}:{}: {}", addr.host,
                                    addr.port, NameLookup::too_many())));
    }
    return c;
}

void SocketConnect::resolved(int rc, const std::vector<sockaddr_storage> &addrs)
{
    std::unique_ptr<NameLookup> done = std::move(lookup_); // freed on return
    if (cancelled_) {
        return;
    }
    addrs_ = addrs;
    if (rc != 0 || addrs_.empty()) {
        finish(Error(fmt::format("address resolution failed for {}:{}: {}", addr_.host,
                                 addr_.port, gai_strerror(rc != 0 ? rc : EAI_NONAME))));
        return;
    }
    try_address(0);
}

// Opens all `count_` connections to address `i`; on any failure the next
// address is tried, as QEMU's inet_connect_saddr() walks getaddrinfo's list.
void SocketConnect::try_address(size_t i)
{
    current_ = i;
    fds_.assign(count_, -1);
    error_.reset();
    launching_ = true; // a connect failing at once must not end the round early
    for (unsigned k = 0; k < count_; k++) {
        auto *a = new Attempt;
        a->owner = shared_from_this();
        a->index = k;
        a->h.init(loop_, addr_.type, a);
        pending_.push_back(a);
        if (addr_.type == SocketAddress::Type::Unix) {
            uv_pipe_connect(&a->req, &a->h.pipe, addr_.path.c_str(), on_connect);
            continue; // errors come through on_connect
        }
        int rc = uv_tcp_connect(&a->req, &a->h.tcp, reinterpret_cast<const sockaddr *>(&addrs_[i]),
                                on_connect);
        if (rc != 0) {
            connected(a, rc);
        }
    }
    launching_ = false;
    round_done();
}

void SocketConnect::on_connect(uv_connect_t *req, int status)
{
    auto *a = reinterpret_cast<Attempt *>(req);
    a->owner->connected(a, status);
}

void SocketConnect::connected(Attempt *a, int status)
{
    if (status == 0 && !cancelled_) {
        uv_os_fd_t ufd;
        uv_fileno(a->h.handle(), &ufd);
        auto fd = take_blocking_fd(ufd);
        if (fd) {
            fds_[a->index] = *fd;
        } else if (!error_) {
            error_ = fd.error();
        }
    } else if (status < 0 && !error_) {
        // QEMU's text: strerror() ("Connection refused"), not libuv's.
        error_.emplace(fmt::format("Failed to connect to '{}': {}", addr_.display(),
                                   std::strerror(-status)));
    }
    pending_.erase(std::find(pending_.begin(), pending_.end(), a));
    if (!uv_is_closing(a->h.handle())) {
        close_attempt(a);
    }
    round_done();
}

// All connects to the current address are back: done, or the next address.
void SocketConnect::round_done()
{
    if (launching_ || !pending_.empty() || cancelled_) {
        return;
    }
    if (error_) {
        close_fds();
        if (current_ + 1 < addrs_.size()) {
            try_address(current_ + 1);
            return;
        }
        finish(*error_);
        return;
    }
    finish(fds_);
}

void SocketConnect::close_attempt(Attempt *a)
{
    uv_close(a->h.handle(),
             [](uv_handle_t *h) { delete static_cast<Attempt *>(h->data); });
}

void SocketConnect::close_fds()
{
    for (int &fd : fds_) {
        if (fd >= 0) {
            ::close(fd);
        }
        fd = -1;
    }
}

void SocketConnect::finish(Result<std::vector<int>> r)
{
    Done done = std::move(done_);
    done_ = nullptr;
    if (done) {
        done(std::move(r));
    }
}

void SocketConnect::cancel()
{
    if (cancelled_) {
        return;
    }
    cancelled_ = true;
    done_ = nullptr;
    lookup_.reset(); // its answer is dropped; the reference it held goes

    for (Attempt *a : pending_) {
        // Closing a connecting handle makes its callback run with ECANCELED.
        close_attempt(a);
    }
    close_fds();
}

} // namespace qmigd
