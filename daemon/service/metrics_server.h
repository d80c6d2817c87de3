// --metrics HOST:PORT: /metrics over HTTP for Prometheus to scrape
// (monitor/metrics.h makes the text). Anyone who reaches the port may be
// hostile, so the server is GNU libmicrohttpd (Debian's libmicrohttpd),
// driven from one thread of ours, and every resource a stranger can hold
// is bounded:
//   - connections: at most MetricsLimits::connections at once (the rest
//     wait in the kernel's backlog); when the cap is full the oldest are
//     cut, so a newcomer always gets a place;
//   - time: each connection has a deadline from its accept, whatever it
//     sends (a byte a second included); one request per connection
//     (Connection: close), so it is a deadline per request;
//   - memory: a fixed pool per connection (the request line and headers
//     must fit it; longer ones get 431), so at most connections x pool;
//   - the answer: only GET/HEAD /metrics, no Range (libmicrohttpd has none).
// stop() ends within a few milliseconds whatever the clients do: nothing
// waits for a client, and a scrape waiting for the loop thread is woken.
//
// A scrape asks the loop thread for the text (it reads the daemon's state
// where the monitor does) and waits at most 2 s for it, holding the
// server thread: the loop answers in microseconds when it is healthy.
// Scrapes within 50 ms of one another get the same text, so a flood of
// requests costs the loop thread at most 20 texts a second.
//
// Thread ownership: start() and stop() on the loop thread; everything
// else on the server thread (serve() and libmicrohttpd's callbacks).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "daemon/io/unique_fd.h"
#include "daemon/loop_dispatcher.h"
#include "protocol/error.h"

struct MHD_Daemon;
struct MHD_Connection;

namespace qmigd {

struct MetricsLimits {
    unsigned connections = 512;
    std::chrono::milliseconds deadline{5000};
    size_t memory_per_connection = 16 << 10;
};

class MetricsServer {
public:
    // `text` runs on the loop thread (through `dispatcher`).
    MetricsServer(LoopDispatcher &dispatcher, std::function<std::string()> text,
                  MetricsLimits limits = {});
    ~MetricsServer();

    // "HOST:PORT" or "tcp:HOST:PORT" (QEMU's spelling); port 0 picks one.
    Status start(const std::string &address);
    // Cuts every connection and joins the thread; a scrape in flight gets 503.
    void stop();
    int port() const { return port_; }
    // Connections accepted so far (any thread: a test waits on it to know
    // the server has seen its client).
    uint64_t accepted() const { return accepted_.load(); }

    // A request's answer (server thread; public for the C callbacks).
    struct Answer {
        unsigned status;
        std::string body;
        std::string content_type;
    };
    Answer answer(const std::string &method, const std::string &url);
    // libmicrohttpd's connection notifications (server thread).
    void *connection_started(MHD_Connection *c);
    void connection_closed(void *tracked);

private:
    struct Exchange; // the scrape's text between the loop and the server thread
    struct Tracked {
        int fd = -1;
        std::chrono::steady_clock::time_point deadline;
        bool cut = false;
        std::list<Tracked>::iterator self;
    };
    using Clock = std::chrono::steady_clock;

    void serve();
    // Cuts connections past their deadline, and the oldest when the cap is
    // full; returns the milliseconds until the next deadline (-1: none).
    int sweep();
    void cut(Tracked &t);
    std::string loop_text(bool *ok);

    // Set at construction, then read-only.
    LoopDispatcher &dispatcher_;
    std::function<std::string()> text_;
    MetricsLimits limits_;
    std::shared_ptr<Exchange> exchange_; // its members guarded by its own mutex
    // Set by start() before the server thread starts; the server thread's
    // from then on (serve() stops it); stop() joins that thread.
    MHD_Daemon *mhd_ = nullptr;
    // eventfd: stop() wakes serve(). Opened by start() before the thread
    // starts, closed by stop() after joining it.
    UniqueFd wake_fd_;
    std::thread thread_; // start() and stop() only
    int port_ = 0;       // set by start(), then read-only
    // Open connections, oldest first (server thread only).
    std::list<Tracked> tracked_;
    std::atomic<uint64_t> accepted_{0}; // written by the server thread
    // The last text and when it was made (server thread only).
    static constexpr std::chrono::milliseconds kReuse{50};
    std::string text_cache_;
    Clock::time_point made_{};
    bool closed_ = false; // a connection closed in the last run (server thread)
};

} // namespace qmigd
