// Listening for migration channels over stream sockets (TCP and unix): accept
// with prefix reads, to classify a connection as QEMU does, by its first bytes.
//
// Loop thread only: every class here lives and is called on the loop.
// (Connecting is daemon/io/socket_connect.h, included here for the files that
// still take both from this header.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <netdb.h>
#include <string>
#include <vector>

#include <uv.h>

#include "daemon/io/name_lookup.h"
#include "daemon/io/socket_address.h"
#include "daemon/io/socket_connect.h"
#include "daemon/io/stream_handle.h"
#include "daemon/io/unique_fd.h"
#include "protocol/error.h"

namespace qmigd {

// An accepted connection whose first bytes are being read on the loop.
// Lifetime: owned by the listener until handed over or closed.
//
// Until it has identified itself a connection is a stranger's: it has a
// deadline (ListenerLimits::identify_ms from its accept) and a
// place among at most ListenerLimits::max_pending; when a new connection finds
// them all taken, of those that sent some bytes and stopped the one silent
// the longest goes, else the oldest that sent nothing (evict_one()). A
// migration source sends its first bytes in one write, so a flood of
// stalled prefixes evicts itself, never the source's channels; a flood of
// idle connections gives a channel the flood's turnover to speak.
class PendingConnection {
public:
    // A multifd init message is 64 bytes; a TLS ClientHello record at most
    // a header and 16 KiB + 2 KiB (RFC 8446 5.2).
    static constexpr size_t kMaxPrefix = 5 + 18432;

    std::vector<uint8_t> prefix() const { return {buf_.begin(), buf_.begin() + long(have_)}; }
    // Reads until the prefix holds `total` (<= kMaxPrefix) bytes, then
    // calls back again.
    void want(size_t total)
    {
        want_ = total;
        buf_.resize(std::max(buf_.size(), total));
    }
    // Hands the socket over as a blocking descriptor (the prefix stays
    // readable via prefix()); the libuv handle is closed.
    Result<UniqueFd> take_socket();
    // Closes the connection.
    void close();

private:
    friend class SocketListener;
    StreamHandle h_;
    class SocketListener *owner_ = nullptr;
    std::vector<uint8_t> buf_; // grown by want()
    size_t have_ = 0;
    size_t want_ = 0;
    bool done_ = false;
    uint64_t accepted_ms_ = 0; // uv_now() at accept
    uint64_t heard_ms_ = 0;    // uv_now() at accept or the last bytes read
};

// What strangers may hold of a listener (see PendingConnection).
struct ListenerLimits {
    size_t max_pending = 256;
    uint64_t identify_ms = 10000;
};

// Strangers dropped since the last log line: one line per sweep, not one
// per connection of a flood. Loop thread.
struct DroppedStrangers {
    uint64_t evicted = 0, expired = 0;
    // Connections that closed or reset before they identified themselves
    // (a port scan, a probe): they cost the migration nothing.
    uint64_t gone = 0;
    // `what`: "connections", "TLS connections"; `rule`: who goes first.
    void log(const char *what, const char *rule, const ListenerLimits &limits);
};

// A warning said at most once a second, with how many more there were in
// between: strangers cause these, and a flood of them must not flood the
// log. Loop thread.
class RateLimitedLog {
public:
    void warn(uint64_t now_ms, const std::string &line);

private:
    bool said_ = false;
    uint64_t said_ms_ = 0; // uv_now() of the last line
    uint64_t quiet_ = 0;   // not said since
};

// A repeating timer that checks strangers' deadlines: every quarter of
// identify_ms (at least 50 ms), with `data` as its data. Loop thread.
uv_timer_t *sweeper_start(uv_loop_t *loop, const ListenerLimits &limits, void *data,
                          uv_timer_cb cb);
// Stops and frees it (after libuv closes it); sets *t to null.
void sweeper_close(uv_timer_t **t);

class SocketListener {
public:
    // Called when a connection has `want` bytes (set want() for more, or
    // take_socket()/close()). One that ends before is a stranger's, closed
    // and counted here: whoever reaches the port cannot end a migration by
    // connecting and going away.
    using OnPrefix = std::function<void(PendingConnection *)>;

    SocketListener(uv_loop_t *loop, size_t first_want, OnPrefix on_prefix,
                   ListenerLimits limits = ListenerLimits())
        : loop_(loop), first_want_(first_want), on_prefix_(std::move(on_prefix)), limits_(limits)
    {
    }
    ~SocketListener();
    // Called at each accept, before any byte is read: returning true means
    // the hook took (or closed) the connection.
    using OnAccept = std::function<bool(PendingConnection *)>;
    void set_on_accept(OnAccept f) { on_accept_ = std::move(f); }
    // Called once a listen that resolves a name is up, or failed (then
    // the listener is closed); it may destroy the listener.
    using OnListening = std::function<void(const Status &)>;
    // A unix path is unlinked first and again at close(), as QEMU does. A
    // numeric address or an empty host (every interface) is bound before
    // this returns. A host name is resolved off the loop (NameLookup), as
    // SocketConnect does: a lookup may take the resolver's whole timeout
    // (seconds per server and search domain), which the loop -- QMP, the
    // watchdog, /metrics, quit -- must not wait for. Then listen() returns
    // at once with resolving() true, and on_listening reports the end.
    Status listen(const SocketAddress &addr, OnListening on_listening = nullptr);
    bool resolving() const { return lookup_ != nullptr; }
    // What it listens on, with the port the kernel chose for port 0.
    const SocketAddress &address() const { return addr_; }
    // Stops accepting and closes every pending connection.
    void close();
    bool listening() const { return server_ != nullptr && !lookup_; }

private:
    friend class PendingConnection;
    void resolved(int rc, const std::vector<sockaddr_storage> &addrs);
    Status bind_and_listen(const sockaddr *sa);
    static void on_connection(uv_stream_t *server, int status);
    void start_reading(PendingConnection *c);
    void release(PendingConnection *c);
    // Makes room for one more pending connection: the one silent longest goes.
    void evict_one();
    // Timer: closes pending connections past their deadline.
    void sweep();

    uv_loop_t *loop_;
    size_t first_want_;
    OnPrefix on_prefix_;
    OnAccept on_accept_;
    ListenerLimits limits_;
    StreamHandle *server_ = nullptr;
    std::unique_ptr<NameLookup> lookup_; // a name being resolved
    OnListening on_listening_;
    uv_timer_t *sweeper_ = nullptr;
    SocketAddress addr_;
    std::vector<PendingConnection *> pending_;
    DroppedStrangers dropped_;
};

// Blocking: resolves an inet listen address's host to its numeric form
// (the first answer, as a listen takes it). For the start, before the loop
// runs and anyone waits on it; once it runs, SocketListener::listen()
// resolves off the loop.
Status resolve_listen_host(SocketAddress *addr);

} // namespace qmigd
