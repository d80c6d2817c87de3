// The source's side of xbzrle (QEMU's save_xbzrle_page()): from the second
// round on, a page whose previous copy is cached goes as its delta
// against that copy (protocol/xbzrle.h), an unchanged one not at all.
// Pages are cached as they are sent, so the cache always holds what the
// destination has. The first round sends everything whole, uncached.
//
// Thread ownership: the migration thread only (RamSave calls it); the
// counters are published by MigrationThread::publish().
#pragma once

#include <cstdint>
#include <memory>

#include "protocol/qemu_format.h"
#include "ramstate/page_cache.h"

namespace qmigd {

// query-migrate's xbzrle-cache counters, as QEMU counts them.
struct XbzrleCounters {
    uint64_t pages = 0;      // cache hits: pages encoded (sent, unchanged or overflowing)
    uint64_t bytes = 0;      // XBZRLE record bytes, less 8 each; a whole page for an overflow
    uint64_t cache_miss = 0;
    uint64_t overflow = 0;   // deltas that came out larger than the page
};

class XbzrleSave {
public:
    enum class Outcome {
        Encoded,   // encoded() holds the delta: send an XBZRLE record
        Unchanged, // the destination has this page already: send nothing
        Whole,     // send the page whole, from *page (maybe the cached copy)
    };

    explicit XbzrleSave(std::unique_ptr<PageCache> cache) : cache_(std::move(cache)) {}

    // After the first round (the pages the destination has are now cached
    // as they go); until then every page is Whole.
    void start() { started_ = !stopped_; }
    // Postcopy sends no deltas from its switch on: they would land on
    // pages the destination may not have.
    void stop() { started_ = false, stopped_ = true; }
    bool started() const { return started_; }
    // The pages' age is counted in dirty syncs.
    void on_dirty_sync() { generation_++; }
    // With the VM stopped nothing is cached any more: it is the last send.
    void set_last_stage() { last_stage_ = true; }

    // `addr`: the page's address across all blocks; `*page` its bytes now,
    // replaced by the cached copy where that is what must be sent.
    Outcome save(uint64_t addr, const uint8_t **page);
    // A page sent as a zero page: its cached copy, if any, is zeros too.
    void zero_page(uint64_t addr);
    const uint8_t *encoded() const { return encoded_.get(); }
    uint16_t encoded_len() const { return encoded_len_; }

    XbzrleCounters counters;

private:
    std::unique_ptr<PageCache> cache_;
    bool started_ = false;
    bool stopped_ = false;
    bool last_stage_ = false;
    uint64_t generation_ = 0;
    // The page as it was when encoded: the guest may write it meanwhile.
    std::unique_ptr<uint8_t[]> current_{new uint8_t[TARGET_PAGE_SIZE]};
    std::unique_ptr<uint8_t[]> encoded_{new uint8_t[TARGET_PAGE_SIZE]};
    uint16_t encoded_len_ = 0;
};

} // namespace qmigd
