// libuv side of the migration channels: listen/accept with prefix reads
// (to classify a connection as QEMU does, by its first bytes) and
// connect. Loop thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <netdb.h>
#include <string>
#include <vector>

#include <uv.h>

#include "protocol/error.h"

namespace qmigd {

struct TcpAddress {
    std::string host;
    uint16_t port = 0;
};

// Parses "tcp:HOST:PORT" (HOST may be [v6]). QEMU's error texts.
Result<TcpAddress> parse_tcp_uri(const std::string &uri);

// An accepted connection whose first bytes are being read on the loop.
// Lifetime: owned by the listener until handed over or closed.
class PendingConnection {
public:
    static constexpr size_t kMaxPrefix = 64;

    std::vector<uint8_t> prefix() const { return {buf_, buf_ + have_}; }
    // Reads until the prefix holds `total` (<= kMaxPrefix) bytes, then
    // calls back again.
    void want(size_t total) { want_ = total; }
    // Hands the socket over as a blocking fd (the prefix stays readable via
    // prefix()); the libuv handle is closed.
    Result<int> take();
    // Closes the connection.
    void close();

private:
    friend class TcpListener;
    uv_tcp_t tcp_;
    class TcpListener *owner_ = nullptr;
    uint8_t buf_[kMaxPrefix];
    size_t have_ = 0;
    size_t want_ = 0;
    bool done_ = false;
};

class TcpListener {
public:
    // Called when a connection has `want` bytes (set want() for more, or
    // take()/close()), or with nullptr data and an error when it failed.
    using OnPrefix = std::function<void(PendingConnection *, const Error *)>;

    TcpListener(uv_loop_t *loop, size_t first_want, OnPrefix on_prefix)
        : loop_(loop), first_want_(first_want), on_prefix_(std::move(on_prefix))
    {
    }
    ~TcpListener();
    Status listen(const TcpAddress &addr);
    uint16_t port() const { return port_; }
    // Stops accepting and closes every pending connection.
    void close();
    bool listening() const { return server_ != nullptr; }

private:
    friend class PendingConnection;
    static void on_connection(uv_stream_t *server, int status);
    void start_reading(PendingConnection *c);
    void release(PendingConnection *c);

    uv_loop_t *loop_;
    size_t first_want_;
    OnPrefix on_prefix_;
    uv_tcp_t *server_ = nullptr;
    uint16_t port_ = 0;
    std::vector<PendingConnection *> pending_;
};

// Connects `count` sockets to addr: the name is resolved on libuv's thread
// pool and each address tried in turn (QEMU's inet_connect_saddr). `done`
// runs once, with all fds (blocking, the caller's) or the first error in
// QEMU's words -- unless cancel() came first: it aborts the lookup and the
// connects at once, and `done` never runs. Loop thread only.
class TcpConnect : public std::enable_shared_from_this<TcpConnect> {
public:
    using Done = std::function<void(Result<std::vector<int>>)>;
    static std::shared_ptr<TcpConnect> start(uv_loop_t *loop, const TcpAddress &addr,
                                             unsigned count, Done done);
    void cancel();

private:
    struct Attempt;
    TcpConnect(uv_loop_t *loop, TcpAddress addr, unsigned count, Done done)
        : loop_(loop), addr_(std::move(addr)), count_(count), done_(std::move(done))
    {
    }
    static void on_resolved(uv_getaddrinfo_t *req, int status, addrinfo *res);
    static void on_connect(uv_connect_t *req, int status);
    void try_address(size_t i);
    void connected(Attempt *a, int status);
    void round_done();
    static void close_attempt(Attempt *a);
    void close_fds();
    void finish(Result<std::vector<int>> r);

    uv_loop_t *loop_;
    TcpAddress addr_;
    unsigned count_;
    Done done_;
    std::string port_text_;
    uv_getaddrinfo_t gai_;
    std::shared_ptr<TcpConnect> resolving_; // self, while the lookup runs
    std::vector<sockaddr_storage> addrs_;
    size_t current_ = 0;
    std::vector<Attempt *> pending_; // connects in flight
    std::vector<int> fds_;
    std::optional<Error> error_;
    bool cancelled_ = false;
    bool launching_ = false;
};

} // namespace qmigd
