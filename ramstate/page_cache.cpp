// The XBZRLE page cache: direct-mapped page copies, each slot kept while its page stays in use.
#include "ramstate/page_cache.h"

#include <bit>
#include <cstring>
#include <new>

namespace qmigd {

PageCache::PageCache(uint64_t slots, size_t page_size) : page_size_(page_size), slots_(slots) {}

Result<std::unique_ptr<PageCache>> PageCache::create(uint64_t bytes, size_t page_size)
{
    uint64_t slots = bytes / page_size;
    if (slots == 0 || !std::has_single_bit(slots)) {
        return Error("xbzrle-cache-size must be a power of two number of pages");
    }
    std::unique_ptr<PageCache> c(new PageCache(slots, page_size));
    // Default-initialised: a large array comes from mmap, and only the
    // pages of slots that fill are ever touched.
    c->memory_.reset(new (std::nothrow) uint8_t[slots * page_size]);
    if (!c->memory_) {
        return Error("Failed to allocate the xbzrle page cache");
    }
    return c;
}

bool PageCache::lookup(uint64_t addr, uint64_t now)
{
    Slot &s = slot(addr);
    if (s.addr != addr) {
        return false;
    }
    s.age = now;
    return true;
}

uint8_t *PageCache::insert(uint64_t addr, const uint8_t *data, uint64_t now)
{
    Slot &s = slot(addr);
    if (s.data && s.addr != addr && s.age + kLifetime > now) {
        return nullptr; // another page uses it still
    }
    if (!s.data) {
        s.data = memory_.get() + size_t(&s - slots_.data()) * page_size_;
    }
    std::memcpy(s.data, data, page_size_);
    s.addr = addr;
    s.age = now;
    return s.data;
}

} // namespace qmigd
