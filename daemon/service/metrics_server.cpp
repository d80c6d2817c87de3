// /metrics over HTTP: the libmicrohttpd server thread, its connection bounds and the scrape.
#include "daemon/service/metrics_server.h"

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdarg>
#include <cstring>
#include <optional>

#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include "daemon/io/socket_address.h"
#include "daemon/thread_name.h"
#include "daemon/thread_safety.h"

namespace qmigd {

// The scrape in flight: the server thread waits here for the loop thread's
// text, or for stop(). Shared with the closure posted to the loop, which
// may run after the server is gone.
struct MetricsServer::Exchange {
    Mutex mu;
    std::condition_variable cv; // text set, or stopping
    uint64_t asked GUARDED_BY(mu) = 0;
    std::optional<std::string> text GUARDED_BY(mu); // the answer to `asked`
    bool stopping GUARDED_BY(mu) = false;
};

namespace {

// HOST:PORT or tcp:HOST:PORT, [V6]:PORT, into host and port: the parser
// of the migration's tcp: addresses (and --listen's), so both take the same.
Status parse_address(const std::string &address, std::string *host, int *port)
{
    std::string a = address.rfind("tcp:", 0) == 0 ? address : "tcp:" + address;
    auto parsed = parse_socket_uri(a);
    if (!parsed) {
        return Error("--metrics '" + address + "': expected HOST:PORT or tcp:HOST:PORT, the "
                     "port must be a number up to 65535");
    }
    *host = parsed->host;
    *port = parsed->port;
    return {};
}

// libmicrohttpd's own complaints (a client's malformed request, a full
// pool): strangers cause them, so they stay at debug level.
void mhd_log(void *, const char *fmt, va_list ap)
{
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    spdlog::debug("metrics: {}", line);
}

MHD_Result on_request(void *cls, MHD_Connection *c, const char *url, const char *method,
                      const char *, const char *, size_t *upload_size, void **)
{
    *upload_size = 0; // a body is not read, only dropped
    auto a = static_cast<MetricsServer *>(cls)->answer(method, url);
    MHD_Response *r = MHD_create_response_from_buffer(a.body.size(), a.body.data(),
                                                      MHD_RESPMEM_MUST_COPY);
    if (!r) {
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, a.content_type.c_str());
    // One request per connection: the deadline counts from the accept.
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    if (a.status == MHD_HTTP_METHOD_NOT_ALLOWED) {
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    }
    MHD_Result ok = MHD_queue_response(c, a.status, r);
    MHD_destroy_response(r);
    return ok;
}

void on_connection(void *cls, MHD_Connection *c, void **socket_context,
                   MHD_ConnectionNotificationCode code)
{
    auto *server = static_cast<MetricsServer *>(cls);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        *socket_context = server->connection_started(c);
    } else if (*socket_context) {
        server->connection_closed(*socket_context);
    }
}

} // namespace

MetricsServer::MetricsServer(LoopDispatcher &dispatcher, std::function<std::string()> text,
                             MetricsLimits limits)
    : dispatcher_(dispatcher), text_(std::move(text)), limits_(limits),
      exchange_(std::make_shared<Exchange>())
{
}

MetricsServer::~MetricsServer() { stop(); }

Status MetricsServer::start(const std::string &address)
{
    std::string host;
    int port = 0;
    QMIGD_TRY(parse_address(address, &host, &port));
    addrinfo hints = {};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo *ai = nullptr;
    std::string service = std::to_string(port);
    if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &ai) != 0) {
        return Error("--metrics '" + address + "': cannot listen there (unknown host)");
    }
    unsigned flags = MHD_USE_EPOLL | MHD_USE_ERROR_LOG |
                     (ai->ai_family == AF_INET6 ? MHD_USE_IPv6 : 0);
    mhd_ = MHD_start_daemon(
        flags, 0, nullptr, nullptr, &on_request, this, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
        MHD_OPTION_CONNECTION_LIMIT, limits_.connections, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
        limits_.memory_per_connection, MHD_OPTION_NOTIFY_CONNECTION, &on_connection, this,
        MHD_OPTION_EXTERNAL_LOGGER, &mhd_log, nullptr, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!mhd_) {
        return Error("--metrics '" + address + "': cannot listen there");
    }
    port_ = MHD_get_daemon_info(mhd_, MHD_DAEMON_INFO_BIND_PORT)->port;
    wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_fd_) {
        MHD_stop_daemon(mhd_);
        mhd_ = nullptr;
        return Error(std::string("--metrics: eventfd: ") + std::strerror(errno));
    }
    thread_ = std::thread([this] { serve(); });
    spdlog::info("metrics: http://{}:{}/metrics",
                 host.find(':') == std::string::npos ? host : "[" + host + "]", port_);
    return {};
}

void MetricsServer::stop()
{
    if (!thread_.joinable()) {
        return;
    }
    {
        MutexLock l(exchange_->mu);
        exchange_->stopping = true;
    }
    exchange_->cv.notify_all();
    uint64_t one = 1;
    (void)!::write(wake_fd_.get(), &one, sizeof one);
    thread_.join();
    wake_fd_.reset();
}

// The server thread: libmicrohttpd's epoll descriptor and our wake-up,
// with the deadlines between. It ends the daemon itself, which closes
// every connection without waiting for any client.
void MetricsServer::serve()
{
    set_thread_name("metrics");
    int epoll_fd = MHD_get_daemon_info(mhd_, MHD_DAEMON_INFO_EPOLL_FD)->epoll_fd;
    while (true) {
        int timeout = sweep();
        MHD_UNSIGNED_LONG_LONG mhd_ms;
        if (MHD_get_timeout(mhd_, &mhd_ms) == MHD_YES) {
            int m = int(std::min<MHD_UNSIGNED_LONG_LONG>(mhd_ms, 60000));
            timeout = timeout < 0 ? m : std::min(timeout, m);
        }
        // libmicrohttpd watches its listening socket again (below the cap)
        // only in the run after a close: give it that run now.
        if (closed_) {
            timeout = 0;
            closed_ = false;
        }
        pollfd fds[2] = {{epoll_fd, POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
        if (::poll(fds, 2, timeout) < 0 && errno != EINTR) {
            spdlog::error("metrics: poll: {}", std::strerror(errno));
            break;
        }
        if (fds[1].revents) {
            break;
        }
        MHD_run(mhd_);
    }
    MHD_stop_daemon(mhd_); // closes every connection; notifications come here
    mhd_ = nullptr;
    tracked_.clear();
}

void *MetricsServer::connection_started(MHD_Connection *c)
{
    const MHD_ConnectionInfo *info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    Tracked &t = tracked_.emplace_back();
    t.fd = info ? info->connect_fd : -1;
    t.deadline = Clock::now() + limits_.deadline;
    t.self = std::prev(tracked_.end());
    accepted_++;
    return &t;
}

void MetricsServer::connection_closed(void *tracked)
{
    tracked_.erase(static_cast<Tracked *>(tracked)->self);
    closed_ = true;
}

// Shutting the socket (not closing it: libmicrohttpd owns the descriptor)
// makes its next read end, and libmicrohttpd closes the connection.
void MetricsServer::cut(Tracked &t)
{
    if (!t.cut && t.fd >= 0) {
        ::shutdown(t.fd, SHUT_RDWR);
    }
    t.cut = true;
}

int MetricsServer::sweep()
{
    auto now = Clock::now();
    // A full cap: the oldest eighth goes, so newcomers find room at once
    // (a well-behaved scrape lasts milliseconds, it is never the oldest).
    if (tracked_.size() >= limits_.connections) {
        size_t n = std::max<size_t>(1, limits_.connections / 8);
        for (auto &t : tracked_) {
            if (n == 0) {
                break;
            }
            if (!t.cut) {
                cut(t);
                --n;
            }
        }
    }
    int next = -1;
    for (auto &t : tracked_) { // deadlines grow along the list
        if (t.cut) {
            continue;
        }
        if (t.deadline > now) {
            next = int(std::chrono::duration_cast<std::chrono::milliseconds>(t.deadline - now)
                           .count()) + 1;
            break;
        }
        cut(t);
    }
    return next;
}

MetricsServer::Answer MetricsServer::answer(const std::string &method, const std::string &url)
{
    if (url != "/metrics") {
        return {MHD_HTTP_NOT_FOUND, "qmigd serves /metrics only\n", "text/plain"};
    }
    if (method != "GET" && method != "HEAD") {
        return {MHD_HTTP_METHOD_NOT_ALLOWED, "GET or HEAD\n", "text/plain"};
    }
    // Clients asking faster than kReuse share one text: however many
    // there are, the loop thread makes at most 1 s / kReuse a second.
    auto now = Clock::now();
    if (made_.time_since_epoch().count() == 0 || now - made_ >= kReuse) {
        bool ok = false;
        std::string text = loop_text(&ok);
        if (!ok) {
            return {MHD_HTTP_SERVICE_UNAVAILABLE, "qmigd: the daemon did not answer\n",
                    "text/plain"};
        }
        text_cache_ = std::move(text);
        made_ = now;
    }
    return {MHD_HTTP_OK, text_cache_, "text/plain; version=0.0.4; charset=utf-8"};
}

// The text is made where the state lives: on the loop thread.
std::string MetricsServer::loop_text(bool *ok)
{
    std::shared_ptr<Exchange> ex = exchange_;
    uint64_t id;
    {
        MutexLock l(ex->mu);
        id = ++ex->asked;
        ex->text.reset();
    }
    dispatcher_.post([ex, id, text = text_] {
        std::string t = text();
        MutexLock l(ex->mu);
        if (ex->asked == id) {
            ex->text = std::move(t);
            ex->cv.notify_all();
        }
    });
    MutexLock l(ex->mu);
    auto until = Clock::now() + std::chrono::seconds(2);
    while (!ex->stopping && !ex->text && l.wait_until(ex->cv, until)) {
    }
    *ok = ex->text.has_value() && !ex->stopping;
    return *ok ? std::move(*ex->text) : std::string();
}

} // namespace qmigd
