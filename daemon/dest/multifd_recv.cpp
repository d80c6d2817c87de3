// The destination's multifd SYNC barrier (multifd_recv.h).
#include "daemon/dest/multifd_recv.h"

#include <fmt/format.h>

namespace qmigd {

bool MultifdRecvSync::channel_sync(size_t ch)
{
    MutexLock lk(mu_);
    uint64_t epoch = ++synced_[ch];
    cv_.notify_all();
    while (!aborted_ && released_ < epoch) {
        lk.wait(cv_);
    }
    return !aborted_;
}

void MultifdRecvSync::channel_closed(size_t ch)
{
    MutexLock lk(mu_);
    closed_[ch] = true;
    cv_.notify_all();
}

Status MultifdRecvSync::main_flush()
{
    MutexLock lk(mu_);
    while (!aborted_ && !all_synced()) {
        lk.wait(cv_);
    }
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

bool MultifdRecvSync::all_synced() const
{
    for (size_t ch = 0; ch < synced_.size(); ch++) {
        if (synced_[ch] <= released_ && !closed_[ch]) {
            return false;
        }
    }
    return true;
}

void MultifdRecvSync::abort()
{
    MutexLock lk(mu_);
    aborted_ = true;
    cv_.notify_all();
}

} // namespace qmigd
