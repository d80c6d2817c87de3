// Runs closures on the libuv loop thread, posted from any thread (one
// uv_async_t; libuv coalesces wake-ups, so the queue is drained whole).
#pragma once

#include <functional>
#include <mutex>
#include <vector>

#include <uv.h>

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

    uv_async_t *async_;
    std::mutex mu_;
    std::vector<std::function<void()>> queue_; // protected by mu_
    bool closed_ = false;                       // protected by mu_
};

} // namespace qmigd
