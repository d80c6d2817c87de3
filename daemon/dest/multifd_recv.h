// Destination multifd: the SYNC barrier between the receive channels and
// the main channel (QEMU's multifd_recv_sync_main / sem_sync).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <vector>

#include "daemon/thread_safety.h"
#include "protocol/error.h"

namespace qmigd {

// Invariant it enforces: a page a channel receives after its k-th SYNC is
// written only after the main channel passed its k-th MULTIFD_FLUSH, and the
// main channel passes that flush only after every channel read SYNC k.
class MultifdRecvSync {
public:
    explicit MultifdRecvSync(size_t channels)
        : synced_(channels, 0), closed_(channels, false)
    {
    }

    // Channel thread, after reading a SYNC packet: blocks until the main
    // channel releases this epoch. False if the migration was aborted.
    bool channel_sync(size_t ch);
    // Channel thread: the channel will not send another SYNC.
    void channel_closed(size_t ch);
    // Main channel thread, at MULTIFD_FLUSH. Pairs with channel_sync().
    Status main_flush();
    // Any thread: wake everybody, the migration is over.
    void abort();

private:
    // Every channel has read SYNC released_ + 1, or closed.
    bool all_synced() const REQUIRES(mu_);

    Mutex mu_;
    std::condition_variable cv_;
    std::vector<uint64_t> synced_ GUARDED_BY(mu_); // SYNC packets read, per channel
    std::vector<bool> closed_ GUARDED_BY(mu_);
    uint64_t released_ GUARDED_BY(mu_) = 0; // MULTIFD_FLUSH records passed by main
    bool aborted_ GUARDED_BY(mu_) = false;
};

} // namespace qmigd
