#include "daemon/dest/multifd_recv.h"

#include <fmt/format.h>

namespace qmigd {

bool MultifdRecvSync::channel_sync(size_t ch)
{
    std::unique_lock<std::mutex> lk(mu_);
    uint64_t epoch = ++synced_[ch];
    cv_.notify_all();
    cv_.wait(lk, [&] { return aborted_ || released_ >= epoch; });
    return !aborted_;
}

void MultifdRecvSync::channel_closed(size_t ch)
{
    std::lock_guard<std::mutex> lk(mu_);
    closed_[ch] = true;
    cv_.notify_all();
}

Status MultifdRecvSync::main_flush()
{
    std::unique_lock<std::mutex> lk(mu_);
    auto ready = [&](size_t ch) { return synced_[ch] > released_ || closed_[ch]; };
    cv_.wait(lk, [&] {
        if (aborted_) {
            return true;
        }
        for (size_t ch = 0; ch < synced_.size(); ch++) {
            if (!ready(ch)) {
                return false;
            }
        }
        return true;
    });
    if (aborted_) {
        return Error("migration aborted");
    }
    for (size_t ch = 0; ch < synced_.size(); ch++) {
        if (synced_[ch] <= released_) {
            return Error(fmt::format("multifd channel {} closed before sync point {}", ch,
                                     released_ + 1));
        }
    }
    released_++;
    cv_.notify_all();
    return {};
}

void MultifdRecvSync::abort()
{
    std::lock_guard<std::mutex> lk(mu_);
    aborted_ = true;
    cv_.notify_all();
}

} // namespace qmigd
