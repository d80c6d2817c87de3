// XbzrleSave: xbzrle's page cache and delta encoding on the source.
#include "daemon/source/xbzrle_save.h"

#include <cstring>

#include "protocol/xbzrle.h"

namespace qmigd {

XbzrleSave::Outcome XbzrleSave::save(uint64_t addr, const uint8_t **page)
{
    if (!cache_->lookup(addr, generation_)) {
        counters.cache_miss++;
        if (!last_stage_) {
            // Sent whole from the cached copy: what the destination gets is
            // what the next delta is taken against.
            if (const uint8_t *copy = cache_->insert(addr, *page, generation_)) {
                *page = copy;
            }
        }
        return Outcome::Whole;
    }
    counters.pages++;
    uint8_t *prev = cache_->data(addr);
    std::memcpy(current_.get(), *page, TARGET_PAGE_SIZE);
    int len = xbzrle_encode(prev, current_.get(), TARGET_PAGE_SIZE, encoded_.get(),
                            TARGET_PAGE_SIZE);
    if (!last_stage_ && len != 0) {
        std::memcpy(prev, current_.get(), TARGET_PAGE_SIZE);
        *page = prev;
    }
    if (len == 0) {
        return Outcome::Unchanged;
    }
    if (len < 0) {
        counters.overflow++;
        counters.bytes += TARGET_PAGE_SIZE;
        return Outcome::Whole;
    }
    encoded_len_ = uint16_t(len);
    return Outcome::Encoded;
}

void XbzrleSave::zero_page(uint64_t addr)
{
    static const uint8_t kZero[TARGET_PAGE_SIZE] = {};
    cache_->insert(addr, kZero, generation_);
}

} // namespace qmigd
