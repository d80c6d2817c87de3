// Which pages of a RAMBlock a destination has received (QEMU's
// receivedmap): set once a page is in the image, cleared by a postcopy
// discard. A postcopy recovery sends it to the source, which sends again
// every page not in it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace qmigd {

// Thread ownership: any receiving thread sets and clears (atomic words:
// the main and the preempt channel may touch the same word); snapshot()
// is taken by the load thread while the channels are stopped.
class ReceivedBitmap {
public:
    explicit ReceivedBitmap(uint64_t pages)
        : pages_(pages), words_((pages + 63) / 64), bits_(new std::atomic<uint64_t>[words_]())
    {
    }
    void set(uint64_t first_page, uint64_t n) { update(first_page, n, true); }
    void clear(uint64_t first_page, uint64_t n) { update(first_page, n, false); }
    std::vector<uint64_t> snapshot() const
    {
        std::vector<uint64_t> out(words_);
        for (size_t i = 0; i < words_; i++) {
            out[i] = bits_[i].load(std::memory_order_relaxed);
        }
        return out;
    }
    uint64_t pages() const { return pages_; }

private:
    void update(uint64_t first, uint64_t n, bool set)
    {
        for (uint64_t p = first, end = std::min(first + n, pages_); p < end;) {
            uint64_t w = p / 64;
            uint64_t stop = std::min(end, (w + 1) * 64);
            uint64_t mask = (stop - p == 64 ? ~uint64_t(0)
                                            : ((uint64_t(1) << (stop - p)) - 1) << (p % 64));
            if (set) {
                bits_[w].fetch_or(mask, std::memory_order_relaxed);
            } else {
                bits_[w].fetch_and(~mask, std::memory_order_relaxed);
            }
            p = stop;
        }
    }

    const uint64_t pages_;
    const size_t words_;
    std::unique_ptr<std::atomic<uint64_t>[]> bits_;
};

} // namespace qmigd
