// Pages a postcopy destination asks for (MIG_RP_MSG_REQ_PAGES[_ID]): the
// return path's reader checks and queues them, the migration thread sends
// them before anything else (QEMU's ram_save_queue_pages() and
// unqueue_page()).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "daemon/thread_safety.h"
#include "protocol/error.h"
#include "protocol/qemu_format.h"

namespace qmigd {

struct PageRequest {
    size_t block = 0;
    uint64_t offset = 0; // page aligned
    uint64_t len = 0;    // bytes, page aligned, inside the block
};

// Thread ownership: push() runs on the return path's reader thread,
// pop() on the migration thread; the queue is protected by mu_, and
// queued_ mirrors its size so that the migration thread's check between
// pages takes no lock. last_block_ is the reader's alone.
class PageRequests {
public:
    // Requests beyond this many queued are a broken or hostile peer: a
    // destination's faulting threads wait for their pages, a few each.
    static constexpr size_t kMaxQueued = 65536;

    explicit PageRequests(std::vector<RamBlockDesc> blocks) : blocks_(std::move(blocks)) {}

    // A request as it came: idstr null for REQ_PAGES (the block of the
    // previous request). Errors in QEMU's words.
    Status push(const std::string *idstr, uint64_t start, uint32_t len) EXCLUDES(mu_);
    bool pending() const { return queued_.load(std::memory_order_acquire) != 0; }
    std::optional<PageRequest> pop() EXCLUDES(mu_);
    // Until a request is queued or `limit` passed (the migration thread,
    // while it holds the background walk back); true when one is.
    bool wait_pending(std::chrono::milliseconds limit) EXCLUDES(mu_);
    // postcopy-requests: every request, good or bad, as QEMU counts them.
    uint64_t count() const { return count_.load(); }

private:
    const std::vector<RamBlockDesc> blocks_; // set at construction, read-only after
    size_t last_block_ = SIZE_MAX; // reader thread only
    Mutex mu_;
    std::deque<PageRequest> queue_ GUARDED_BY(mu_);
    std::condition_variable queued_cv_; // push() wakes wait_pending()
    std::atomic<size_t> queued_{0};  // written under mu_, read without it
    std::atomic<uint64_t> count_{0}; // atomic: the reader counts, the migration thread reads
};

} // namespace qmigd
