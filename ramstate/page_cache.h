// The source's XBZRLE page cache (QEMU's migration/page_cache.c): the
// copy of each page as last sent, for the next send to be a delta against.
// Direct-mapped: a page's slot is its address in pages modulo the slot
// count, so a lookup is one index. A slot taken by another page is given
// up only once that page has gone unused for CACHED_PAGE_LIFETIME dirty
// syncs, so that pages the guest rewrites all the time keep their slots.
//
// Thread ownership: the migration thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "protocol/error.h"

namespace qmigd {

class PageCache {
public:
    static constexpr uint64_t kLifetime = 2; // CACHED_PAGE_LIFETIME, in dirty syncs

    // `bytes` is xbzrle-cache-size: a power of two number of pages (the
    // monitor checks it). Page memory is taken as slots fill.
    static Result<std::unique_ptr<PageCache>> create(uint64_t bytes, size_t page_size);

    // Whether addr is cached; a hit makes it young again (age = now).
    bool lookup(uint64_t addr, uint64_t now);
    // The cached copy of a page lookup() found.
    uint8_t *data(uint64_t addr) { return slot(addr).data; }
    // Caches data as addr's copy unless its slot holds another page still
    // in use. Returns the copy, or null when not cached.
    uint8_t *insert(uint64_t addr, const uint8_t *data, uint64_t now);
    uint64_t slots() const { return slots_.size(); }

private:
    struct Slot {
        uint64_t addr = UINT64_MAX;
        uint64_t age = 0;
        uint8_t *data = nullptr; // into memory_, once the slot was filled
    };
    PageCache(uint64_t slots, size_t page_size);
    Slot &slot(uint64_t addr) { return slots_[(addr / page_size_) & (slots_.size() - 1)]; }

    const size_t page_size_;
    std::vector<Slot> slots_;
    std::unique_ptr<uint8_t[]> memory_; // slot i's page at i * page_size_
};

} // namespace qmigd
