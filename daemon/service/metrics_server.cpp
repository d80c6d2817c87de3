#include "daemon/service/metrics_server.h"

#include <chrono>
#include <future>

#include <httplib.h>
#include <spdlog/spdlog.h>

namespace qmigd {

MetricsServer::MetricsServer(LoopDispatcher &dispatcher, std::function<std::string()> text)
    : dispatcher_(dispatcher), text_(std::move(text))
{
}

MetricsServer::~MetricsServer() { stop(); }

Status MetricsServer::start(const std::string &address)
{
    std::string a = address.rfind("tcp:", 0) == 0 ? address.substr(4) : address;
    size_t colon = a.rfind(':');
    if (colon == std::string::npos || colon + 1 == a.size()) {
        return Error("--metrics '" + address + "': expected HOST:PORT or tcp:HOST:PORT");
    }
    std::string host = a.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
    }
    int port = 0;
    try {
        port = std::stoi(a.substr(colon + 1));
    } catch (...) {
        port = -1;
    }
    if (port < 0 || port > 65535) {
        return Error("--metrics '" + address + "': the port must be a number up to 65535");
    }
    server_ = std::make_unique<httplib::Server>();
    server_->new_task_queue = [] { return new httplib::ThreadPool(2); };
    server_->set_payload_max_length(4096);
    server_->set_read_timeout(5, 0);
    server_->set_write_timeout(5, 0);
    server_->Get("/metrics", [this](const httplib::Request &, httplib::Response &res) {
        // The text is made where the state lives: on the loop thread.
        auto promise = std::make_shared<std::promise<std::string>>();
        auto done = promise->get_future();
        dispatcher_.post([this, promise] { promise->set_value(text_()); });
        if (done.wait_for(std::chrono::seconds(2)) != std::future_status::ready) {
            res.status = 503;
            res.set_content("qmigd: the daemon did not answer\n", "text/plain");
            return;
        }
        res.set_content(done.get(), "text/plain; version=0.0.4; charset=utf-8");
    });
    if (port == 0) {
        port_ = server_->bind_to_any_port(host);
    } else {
        port_ = server_->bind_to_port(host, port) ? port : -1;
    }
    if (port_ < 0) {
        server_.reset();
        return Error("--metrics '" + address + "': cannot listen there");
    }
    thread_ = std::thread([this] { server_->listen_after_bind(); });
    spdlog::info("metrics: http://{}:{}/metrics", host, port_);
    return {};
}

void MetricsServer::stop()
{
    if (server_) {
        server_->stop();
    }
    if (thread_.joinable()) {
        thread_.join();
    }
    server_.reset();
}

} // namespace qmigd
