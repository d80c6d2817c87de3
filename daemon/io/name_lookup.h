// Host-name lookups that hold up neither the loop nor the daemon's end.
//
// getaddrinfo() may take the resolver's whole timeout (seconds per server
// and search domain) and cannot be interrupted. On libuv's thread pool a
// lookup that has begun cannot be cancelled either, and the loop (and so
// `quit`) waits for it before it can close. So each lookup runs on a
// detached thread of its own and answers through a uv_async_t of its own;
// cancel() closes that handle at once and the thread's answer, whenever it
// comes, is dropped. At most kMaxLookups run at a time (a client asking for
// thousands of names gets an error, not thousands of threads).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <netdb.h>
#include <sys/socket.h>
#include <uv.h>

namespace qmigd {

class NameLookup {
public:
    // rc: getaddrinfo()'s (0, or an EAI_* code); addrs: its answers in order.
    using Done = std::function<void(int rc, const std::vector<sockaddr_storage> &addrs)>;
    // Cancelled lookups count until their thread ends (the resolver's
    // timeout): enough room for a client that retries, a bound for one
    // that floods.
    static constexpr int kMaxLookups = 64;
    static std::string too_many() { return "too many host-name lookups in progress (64)"; }

    // Loop thread. `hints_flags`: getaddrinfo's ai_flags (AI_PASSIVE for a
    // listen). `done` runs on the loop thread, once, unless cancel() came
    // first. Null (and `done` never runs) when kMaxLookups already run:
    // the caller reports too_many().
    static std::unique_ptr<NameLookup> start(uv_loop_t *loop, const std::string &host,
                                             const std::string &port, int hints_flags,
                                             Done done);
    // Loop thread: `done` will not run; the thread is left to finish alone.
    void cancel();
    ~NameLookup() { cancel(); }

private:
    struct Shared; // what the thread and the loop both hold (its own lock)
    NameLookup() = default;
    static void on_async(uv_async_t *h);

    // Loop thread only, all three (Shared's members have their own lock).
    std::shared_ptr<Shared> shared_;
    uv_async_t *async_ = nullptr; // freed in its close callback
    Done done_;
};

} // namespace qmigd
