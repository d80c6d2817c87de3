// Closures posted from any thread, run on the loop thread.
#include "daemon/loop_dispatcher.h"

namespace qmigd {

LoopDispatcher::LoopDispatcher(uv_loop_t *loop) : async_(new uv_async_t)
{
    uv_async_init(loop, async_, on_async);
    async_->data = this;
}

void LoopDispatcher::post(std::function<void()> fn)
{
    // uv_async_send under the lock: close() cannot free the handle between
    // the check and the send.
    MutexLock lk(mu_);
    if (closed_) {
        return;
    }
    queue_.push_back(std::move(fn));
    uv_async_send(async_);
}

void LoopDispatcher::on_async(uv_async_t *h)
{
    auto *self = static_cast<LoopDispatcher *>(h->data);
    std::vector<std::function<void()>> work;
    {
        MutexLock lk(self->mu_);
        work.swap(self->queue_);
    }
    for (auto &fn : work) {
        fn();
    }
}

void LoopDispatcher::close()
{
    {
        MutexLock lk(mu_);
        closed_ = true;
        queue_.clear();
    }
    uv_close(reinterpret_cast<uv_handle_t *>(async_),
             [](uv_handle_t *h) { delete reinterpret_cast<uv_async_t *>(h); });
}

} // namespace qmigd
