// PageRequests: postcopy's page requests, from the return path's reader to the migration thread.
#include "daemon/source/page_requests.h"

#include <algorithm>

#include <fmt/format.h>

#include "protocol/wire.h"

namespace qmigd {

// migrate_handle_rp_req_pages() and ram_save_queue_pages(), in that order.
Status PageRequests::push(const std::string *idstr, uint64_t start, uint32_t len)
{
    count_++;
    if (start % TARGET_PAGE_SIZE || len % TARGET_PAGE_SIZE) {
        return Error(fmt::format(
            "MIG_RP_MSG_REQ_PAGES: Misaligned page request, start:{:x} len: {}", start, len));
    }
    if (!idstr) {
        if (last_block_ == SIZE_MAX) {
            return Error("MIG_RP_MSG_REQ_PAGES has no previous block");
        }
    } else {
        size_t i = 0;
        while (i < blocks_.size() && blocks_[i].idstr != *idstr) {
            i++;
        }
        if (i == blocks_.size()) {
            return Error(fmt::format("MIG_RP_MSG_REQ_PAGES has no block '{}'", wire_text(*idstr)));
        }
        last_block_ = i;
    }
    const RamBlockDesc &b = blocks_[last_block_];
    // QEMU checks the last byte, start + len - 1; the start is checked on
    // its own so that a sum past 2^64 cannot wrap into the block.
    if (start >= b.used_length || start + uint64_t(len) - 1 >= b.used_length) {
        return Error(fmt::format("MIG_RP_MSG_REQ_PAGES request overrun, start={:x} len={:x} "
                                 "blocklen={:x}",
                                 start, len, b.used_length));
    }
    MutexLock lk(mu_);
    if (queue_.size() >= kMaxQueued) {
        return Error(fmt::format("return path: more than {} page requests pending", kMaxQueued));
    }
    // A zero length still asks for the page at start, as in QEMU.
    queue_.push_back({last_block_, start, std::max<uint64_t>(len, TARGET_PAGE_SIZE)});
    queued_.store(queue_.size(), std::memory_order_release);
    queued_cv_.notify_one();
    return {};
}

bool PageRequests::wait_pending(std::chrono::milliseconds limit)
{
    MutexLock lk(mu_);
    auto until = std::chrono::steady_clock::now() + limit;
    while (queue_.empty()) {
        if (!lk.wait_until(queued_cv_, until)) {
            break;
        }
    }
    return !queue_.empty();
}

std::optional<PageRequest> PageRequests::pop()
{
    if (!pending()) {
        return std::nullopt;
    }
    MutexLock lk(mu_);
    if (queue_.empty()) {
        return std::nullopt;
    }
    PageRequest r = queue_.front();
    queue_.pop_front();
    queued_.store(queue_.size(), std::memory_order_release);
    return r;
}

} // namespace qmigd
