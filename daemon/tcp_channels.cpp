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
    if (port.empty() || *end != '\0' || p > 65535 || a.host.empty()) {
        return Error("error parsing address '" + rest + "'");
    }
    a.port = uint16_t(p);
    return a;
}

namespace {

Result<sockaddr_storage> resolve(const TcpAddress &addr)
{
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo *res = nullptr;
    std::string port = std::to_string(addr.port);
    int rc = getaddrinfo(addr.host.c_str(), port.c_str(), &hints, &res);
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

namespace {

// State shared by the connects of one tcp_connect_all() call.
struct ConnectBatch {
    std::function<void(Result<std::vector<int>>)> done;
    TcpAddress addr;
    std::vector<int> fds;
    unsigned outstanding = 0;
    std::optional<Error> error;

    void finish_one()
    {
        if (--outstanding > 0) {
            return;
        }
        if (error) {
            for (int fd : fds) {
                if (fd >= 0) {
                    ::close(fd);
                }
            }
            done(*error);
        } else {
            done(fds);
        }
        delete this;
    }
};

struct ConnectReq {
    uv_connect_t req;
    uv_tcp_t tcp;
    ConnectBatch *batch;
    size_t index;
};

} // namespace

void tcp_connect_all(uv_loop_t *loop, const TcpAddress &addr, unsigned count,
                     std::function<void(Result<std::vector<int>>)> done)
{
    auto ss = resolve(addr);
    if (!ss) {
        done(ss.error());
        return;
    }
    auto *batch = new ConnectBatch{std::move(done), addr, std::vector<int>(count, -1), count, {}};
    for (unsigned i = 0; i < count; i++) {
        auto *r = new ConnectReq;
        r->batch = batch;
        r->index = i;
        uv_tcp_init(loop, &r->tcp);
        r->tcp.data = r;
        int rc = uv_tcp_connect(
            &r->req, &r->tcp, reinterpret_cast<const sockaddr *>(&*ss),
            [](uv_connect_t *req, int status) {
                auto *cr = reinterpret_cast<ConnectReq *>(req);
                ConnectBatch *b = cr->batch;
                if (status < 0 && !b->error) {
                    b->error.emplace(fmt::format("Failed to connect to '{}:{}': {}", b->addr.host,
                                                 b->addr.port, std::strerror(-status)));
                } else if (status == 0) {
                    uv_os_fd_t ufd;
                    uv_fileno(reinterpret_cast<uv_handle_t *>(&cr->tcp), &ufd);
                    auto fd = take_blocking_fd(ufd);
                    if (fd) {
                        b->fds[cr->index] = *fd;
                    } else if (!b->error) {
                        b->error = fd.error();
                    }
                }
                uv_close(reinterpret_cast<uv_handle_t *>(&cr->tcp),
                         [](uv_handle_t *h) { delete static_cast<ConnectReq *>(h->data); });
                b->finish_one();
            });
        if (rc != 0) {
            if (!batch->error) {
                batch->error.emplace(fmt::format("Failed to connect to '{}:{}': {}", addr.host,
                                                 addr.port, std::strerror(-rc)));
            }
            uv_close(reinterpret_cast<uv_handle_t *>(&r->tcp),
                     [](uv_handle_t *h) { delete static_cast<ConnectReq *>(h->data); });
            batch->finish_one();
        }
    }
}

} // namespace qmigd
