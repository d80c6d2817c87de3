// Host-name lookups on detached threads (name_lookup.h says why).
#include "daemon/io/name_lookup.h"

#include <atomic>
#include <cstring>
#include <thread>

#include "daemon/thread_name.h"
#include "daemon/thread_safety.h"

namespace qmigd {

namespace {
std::atomic<int> g_running{0}; // lookup threads alive, any loop
} // namespace

struct NameLookup::Shared {
    Mutex mu;
    // The loop's handle while someone waits for the answer; null once
    // cancel() closed it (the thread then only drops its answer).
    uv_async_t *async GUARDED_BY(mu) = nullptr;
    // Written by the thread before its uv_async_send, read on the loop
    // after the wake-up.
    int rc GUARDED_BY(mu) = EAI_AGAIN;
    std::vector<sockaddr_storage> addrs GUARDED_BY(mu);
};

std::unique_ptr<NameLookup> NameLookup::start(uv_loop_t *loop, const std::string &host,
                                              const std::string &port, int hints_flags,
                                              Done done)
{
    if (g_running.fetch_add(1) >= kMaxLookups) {
        g_running.fetch_sub(1);
        return nullptr;
    }
    std::unique_ptr<NameLookup> l(new NameLookup);
    l->done_ = std::move(done);
    l->shared_ = std::make_shared<Shared>();
    l->async_ = new uv_async_t;
    uv_async_init(loop, l->async_, on_async);
    l->async_->data = l.get();
    {
        MutexLock lock(l->shared_->mu); // no thread yet, but the analysis cannot know
        l->shared_->async = l->async_;
    }
    std::thread([shared = l->shared_, host, port, hints_flags] {
        set_thread_name("qmigd/lookup");
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = hints_flags;
        addrinfo *res = nullptr;
        int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
        std::vector<sockaddr_storage> addrs;
        for (addrinfo *ai = rc == 0 ? res : nullptr; ai; ai = ai->ai_next) {
            sockaddr_storage ss{};
            std::memcpy(&ss, ai->ai_addr, std::min<size_t>(ai->ai_addrlen, sizeof(ss)));
            addrs.push_back(ss);
        }
        if (res) {
            freeaddrinfo(res);
        }
        {
            MutexLock lock(shared->mu);
            shared->rc = rc;
            shared->addrs = std::move(addrs);
            // Under mu: cancel() cannot close the handle between the check
            // and the send. Pairs with the lock in cancel().
            if (shared->async) {
                uv_async_send(shared->async);
            }
        }
        g_running.fetch_sub(1);
    }).detach();
    return l;
}

void NameLookup::on_async(uv_async_t *h)
{
    auto *self = static_cast<NameLookup *>(h->data);
    int rc;
    std::vector<sockaddr_storage> addrs;
    {
        MutexLock lock(self->shared_->mu);
        rc = self->shared_->rc;
        addrs = std::move(self->shared_->addrs);
    }
    Done done = std::move(self->done_);
    self->cancel(); // the handle is done with; `done` may destroy self
    if (done) {
        done(rc, addrs);
    }
}

void NameLookup::cancel()
{
    done_ = nullptr;
    if (!async_) {
        return;
    }
    {
        MutexLock lock(shared_->mu);
        shared_->async = nullptr;
    }
    uv_close(reinterpret_cast<uv_handle_t *>(async_),
             [](uv_handle_t *h) { delete reinterpret_cast<uv_async_t *>(h); });
    async_ = nullptr;
}

} // namespace qmigd
