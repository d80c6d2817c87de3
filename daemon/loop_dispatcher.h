// Runs closures on the libuv loop thread, posted from any thread (one
// uv_async_t; libuv coalesces wake-ups, so the queue is drained whole).
#pragma once

#include <functional>
#include <vector>

#include <uv.h>

#include "daemon/thread_safety.h"

namespace qmigd {

class LoopDispatcher {
public:
    explicit LoopDispatcher(uv_loop_t *loop);
    // Thread-safe. After close() the closure is dropped: the daemon is
    // going away and nobody is left to run it.
    void post(std::function<void()> fn);
    // Loop thread: stop accepting posts and close the handle.
    void close();

private:
    static void on_async(uv_async_t *h);

    // Set at construction; freed by close() on the loop thread, which
    // post() knows by closed_ (under mu_).
    uv_async_t *async_;
    Mutex mu_;
    std::vector<std::function<void()>> queue_ GUARDED_BY(mu_);
    bool closed_ GUARDED_BY(mu_) = false;
};

} // namespace qmigd
