// --metrics HOST:PORT: /metrics over HTTP for Prometheus to scrape
// (monitor/metrics.h makes the text). The HTTP side is cpp-httplib
// (Debian's libcpp-httplib), on a thread of its own with two workers; a
// scrape asks the loop thread for the text, so it reads the daemon's state
// where the monitor does, and waits at most 2 s for it.
//
// Thread ownership: start() and stop() on the loop thread; the handler
// runs on the server's workers and touches nothing but its request.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "daemon/loop_dispatcher.h"
#include "protocol/error.h"

namespace httplib {
class Server;
}

namespace qmigd {

class MetricsServer {
public:
    // `text` runs on the loop thread (through `dispatcher`).
    MetricsServer(LoopDispatcher &dispatcher, std::function<std::string()> text);
    ~MetricsServer();

    // "HOST:PORT" or "tcp:HOST:PORT" (QEMU's spelling); port 0 picks one.
    Status start(const std::string &address);
    // Stops serving and joins the thread; scrapes in flight get 503.
    void stop();
    int port() const { return port_; }

private:
    LoopDispatcher &dispatcher_;
    std::function<std::string()> text_;
    std::unique_ptr<httplib::Server> server_;
    std::thread thread_;
    int port_ = 0;
};

} // namespace qmigd
