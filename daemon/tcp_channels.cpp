#include "daemon/tcp_channels.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <netdb.h>
#include <unistd.h>

#include <fmt/format.h>

#include "daemon/socket_io.h"

namespace qmigd {

Result<TcpAddress> parse_tcp_uri(const std::string &uri)
{
    if (uri.rfind("tcp:", 0) != 0) {
        return Error("unknown migration protocol: " + uri);
    }
    std::string rest = uri.substr(4);
    size_t colon = rest.rfind(':');
    if (colon == std::string::npos) {
        return Error("error parsing address '" + rest + "'");
    }
    TcpAddress a;
    a.host = rest.substr(0, colon);
    if (a.host.size() >= 2 && a.host.front() == '[' && a.host.back() == ']') {
        a.host = a.host.substr(1, a.host.size() - 2);
    }
    std::string port = rest.substr(colon + 1);
    char *end = nullptr;
    unsigned long p = std::strtoul(port.c_str(), &end, 10);
    if (port.empty() || *end != '\0' || p > 65535) {
        return Error("error parsing address '" + rest + "'");
    }
    a.port = uint16_t(p);
    return a;
}

namespace {

// Listen addresses only (numeric or local names; a listen is set up once,
// before the migration, where a blocking lookup harms nobody). An empty host
// is QEMU's "tcp::PORT": every interface.
Result<sockaddr_storage> resolve(const TcpAddress &addr)
{
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo *res = nullptr;
    std::string port = std::to_string(addr.port);
    int rc = getaddrinfo(addr.host.empty() ? nullptr : addr.host.c_str(), port.c_str(), &hints,
                         &res);
    if (rc != 0 || !res) {
        return Error(fmt::format("address resolution failed for {}:{}: {}", addr.host, addr.port,
                                 gai_strerror(rc)));
    }
    sockaddr_storage ss{};
    std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return ss;
}

} // namespace

TcpListener::~TcpListener() { close(); }

Status TcpListener::listen(const TcpAddress &addr)
{
    auto ss = resolve(addr);
    QMIGD_TRY(ss);
    server_ = new uv_tcp_t;
    uv_tcp_init(loop_, server_);
    server_->data = this;
    int rc = uv_tcp_bind(server_, reinterpret_cast<const sockaddr *>(&*ss), 0);
    if (rc == 0) {
        rc = uv_listen(reinterpret_cast<uv_stream_t *>(server_), 64, on_connection);
    }
    if (rc != 0) {
        close();
        return Error(fmt::format("Failed to bind socket for {}:{}: {}", addr.host, addr.port,
                                 uv_strerror(rc)));
    }
    sockaddr_storage bound{};
    int len = sizeof(bound);
    uv_tcp_getsockname(server_, reinterpret_cast<sockaddr *>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6
                      ? reinterpret_cast<sockaddr_in6 *>(&bound)->sin6_port
                      : reinterpret_cast<sockaddr_in *>(&bound)->sin_port);
    return {};
}

void TcpListener::on_connection(uv_stream_t *server, int status)
{
    auto *self = static_cast<TcpListener *>(server->data);
    if (status < 0) {
        return;
    }
    auto *c = new PendingConnection;
    c->owner_ = self;
    c->want_ = self->first_want_;
    uv_tcp_init(self->loop_, &c->tcp_);
    c->tcp_.data = c;
    if (uv_accept(server, reinterpret_cast<uv_stream_t *>(&c->tcp_)) != 0) {
        c->owner_ = nullptr;
        c->close();
        return;
    }
    self->pending_.push_back(c);
    self->start_reading(c);
}

void TcpListener::start_reading(PendingConnection *c)
{
    // The read buffer is exactly the bytes still wanted, so libuv never
    // takes bytes past the prefix off the socket.
    uv_read_start(
        reinterpret_cast<uv_stream_t *>(&c->tcp_),
        [](uv_handle_t *h, size_t, uv_buf_t *buf) {
            auto *pc = static_cast<PendingConnection *>(h->data);
            *buf = uv_buf_init(reinterpret_cast<char *>(pc->buf_ + pc->have_),
                               unsigned(pc->want_ - pc->have_));
        },
        [](uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
            auto *pc = static_cast<PendingConnection *>(s->data);
            TcpListener *self = pc->owner_;
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

void TcpListener::release(PendingConnection *c)
{
    pending_.erase(std::remove(pending_.begin(), pending_.end(), c), pending_.end());
}

Result<int> PendingConnection::take()
{
    uv_os_fd_t ufd;
    uv_fileno(reinterpret_cast<uv_handle_t *>(&tcp_), &ufd);
    uv_read_stop(reinterpret_cast<uv_stream_t *>(&tcp_));
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
    uv_close(reinterpret_cast<uv_handle_t *>(&tcp_),
             [](uv_handle_t *h) { delete static_cast<PendingConnection *>(h->data); });
}

void TcpListener::close()
{
    while (!pending_.empty()) {
        pending_.back()->close();
    }
    if (server_) {
        uv_close(reinterpret_cast<uv_handle_t *>(server_),
                 [](uv_handle_t *h) { delete reinterpret_cast<uv_tcp_t *>(h); });
        server_ = nullptr;
    }
}

struct TcpConnect::Attempt {
    uv_connect_t req;
    uv_tcp_t tcp;
    std::shared_ptr<TcpConnect> owner; // keeps it alive until closed
    size_t index = 0;
};

std::shared_ptr<TcpConnect> TcpConnect::start(uv_loop_t *loop, const TcpAddress &addr,
                                              unsigned count, Done done)
{
    std::shared_ptr<TcpConnect> c(new TcpConnect(loop, addr, count, std::move(done)));
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    c->port_text_ = std::to_string(addr.port);
    c->gai_.data = c.get();
    c->resolving_ = c; // the lookup holds a reference until its callback
    int rc = uv_getaddrinfo(loop, &c->gai_, on_resolved,
                            addr.host.empty() ? nullptr : addr.host.c_str(),
                            c->port_text_.c_str(), &hints);
    if (rc != 0) {
        c->resolving_.reset();
        c->finish(Error(fmt::format("address resolution failed for {}:{}: {}", addr.host,
                                    addr.port, uv_strerror(rc))));
    }
    return c;
}

void TcpConnect::on_resolved(uv_getaddrinfo_t *req, int status, addrinfo *res)
{
    auto *self = static_cast<TcpConnect *>(req->data);
    std::shared_ptr<TcpConnect> keep = std::move(self->resolving_);
    for (addrinfo *ai = res; ai; ai = ai->ai_next) {
        sockaddr_storage ss{};
        std::memcpy(&ss, ai->ai_addr, std::min<size_t>(ai->ai_addrlen, sizeof(ss)));
        self->addrs_.push_back(ss);
    }
    uv_freeaddrinfo(res);
    if (self->cancelled_) {
        return;
    }
    if (status < 0 || self->addrs_.empty()) {
        self->finish(Error(fmt::format("address resolution failed for {}:{}: {}",
                                       self->addr_.host, self->addr_.port,
                                       uv_strerror(status < 0 ? status : UV_EAI_NONAME))));
        return;
    }
    self->try_address(0);
}

// Opens all `count_` connections to address `i`; on any failure the next
// address is tried, as QEMU's inet_connect_saddr() walks getaddrinfo's list.
void TcpConnect::try_address(size_t i)
{
    current_ = i;
    fds_.assign(count_, -1);
    error_.reset();
    launching_ = true; // a connect failing at once must not end the round early
    for (unsigned k = 0; k < count_; k++) {
        auto *a = new Attempt;
        a->owner = shared_from_this();
        a->index = k;
        uv_tcp_init(loop_, &a->tcp);
        a->tcp.data = a;
        pending_.push_back(a);
        int rc = uv_tcp_connect(&a->req, &a->tcp, reinterpret_cast<const sockaddr *>(&addrs_[i]),
                                on_connect);
        if (rc != 0) {
            connected(a, rc);
        }
    }
    launching_ = false;
    round_done();
}

void TcpConnect::on_connect(uv_connect_t *req, int status)
{
    auto *a = reinterpret_cast<Attempt *>(req);
    a->owner->connected(a, status);
}

void TcpConnect::connected(Attempt *a, int status)
{
    if (status == 0 && !cancelled_) {
        uv_os_fd_t ufd;
        uv_fileno(reinterpret_cast<uv_handle_t *>(&a->tcp), &ufd);
        auto fd = take_blocking_fd(ufd);
        if (fd) {
            fds_[a->index] = *fd;
        } else if (!error_) {
            error_ = fd.error();
        }
    } else if (status < 0 && !error_) {
        // QEMU's text: strerror() ("Connection refused"), not libuv's.
        error_.emplace(fmt::format("Failed to connect to '{}:{}': {}", addr_.host, addr_.port,
                                   std::strerror(-status)));
    }
    pending_.erase(std::find(pending_.begin(), pending_.end(), a));
    if (!uv_is_closing(reinterpret_cast<uv_handle_t *>(&a->tcp))) {
        close_attempt(a);
    }
    round_done();
}

// All connects to the current address are back: done, or the next address.
void TcpConnect::round_done()
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

void TcpConnect::close_attempt(Attempt *a)
{
    uv_close(reinterpret_cast<uv_handle_t *>(&a->tcp),
             [](uv_handle_t *h) { delete static_cast<Attempt *>(h->data); });
}

void TcpConnect::close_fds()
{
    for (int &fd : fds_) {
        if (fd >= 0) {
            ::close(fd);
        }
        fd = -1;
    }
}

void TcpConnect::finish(Result<std::vector<int>> r)
{
    Done done = std::move(done_);
    done_ = nullptr;
    if (done) {
        done(std::move(r));
    }
}

void TcpConnect::cancel()
{
    if (cancelled_) {
        return;
    }
    cancelled_ = true;
    done_ = nullptr;
    if (resolving_) {
        uv_cancel(reinterpret_cast<uv_req_t *>(&gai_)); // callback still comes
    }
    for (Attempt *a : pending_) {
        // Closing a connecting handle makes its callback run with ECANCELED.
        close_attempt(a);
    }
    close_fds();
}

} // namespace qmigd
