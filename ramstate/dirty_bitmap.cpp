// The shared dirty bitmap: mapping it, marking pages, get-and-clear, and
// calc-dirty-rate's sync beside the migration's.
#include "ramstate/dirty_bitmap.h"

#include <atomic>
#include <bit>
#include <cstdlib>

namespace qmigd {

static_assert(std::endian::native == std::endian::little,
              "the bitmap file is little-endian 64-bit words");

Result<std::unique_ptr<DirtyBitmap>> DirtyBitmap::open(const std::string &path, uint64_t pages,
                                                     SideFileName name)
{
    auto file = SharedFile::open(path, dirty_bitmap_bytes(pages), "dirty bitmap", name);
    QMIGD_TRY(file);
    std::unique_ptr<DirtyBitmap> bm(new DirtyBitmap());
    bm->file_ = std::move(*file);
    bm->bits_ = static_cast<uint64_t *>(bm->file_->data());
    bm->pages_ = pages;
    bm->words_ = (pages + 63) / 64;
    return bm;
}

DirtyBitmap::~DirtyBitmap()
{
    std::free(pending_.load(std::memory_order_relaxed));
}

void DirtyBitmap::set_dirty(uint64_t page)
{
    // Release: pairs with the acquire in take_word(), so a source that
    // sees the bit also sees the page's new bytes.
    std::atomic_ref<uint64_t>(bits_[page / 64])
        .fetch_or(uint64_t(1) << (page % 64), std::memory_order_release);
}

// Word i of the shared file, cleared there (the caller counts it in
// collected_, once per sync: not an atomic add per dirty word).
uint64_t DirtyBitmap::take_word(size_t i)
{
    std::atomic_ref<uint64_t> w(bits_[i]);
    // Skip clean words without a locked instruction.
    if (w.load(std::memory_order_relaxed) == 0) {
        return 0;
    }
    uint64_t bits = w.exchange(0, std::memory_order_acquire);
    if (i == words_ - 1 && pages_ % 64) {
        // Bits past the last page mean nothing (ramstate/README.md); a
        // writer that sets them must not make us send pages that are not
        // in the image.
        bits &= (uint64_t(1) << (pages_ % 64)) - 1;
    }
    return bits;
}

uint64_t DirtyBitmap::take_pending_word(size_t i)
{
    std::atomic_ref<uint64_t> w(pending_.load(std::memory_order_acquire)[i]);
    return w.load(std::memory_order_relaxed) ? w.exchange(0, std::memory_order_acquire) : 0;
}

uint64_t DirtyBitmap::sync_and_clear(std::vector<uint64_t> &dest,
                                     const std::function<void(size_t, uint64_t)> &on_word)
{
    // Acquire: pairs with the release in sync_to_pending().
    bool pending = has_pending_.exchange(false, std::memory_order_acquire);
    uint64_t count = 0, taken = 0;
    for (size_t i = 0; i < words_; i++) {
        uint64_t own = take_word(i);
        taken += uint64_t(std::popcount(own));
        uint64_t bits = own | (pending ? take_pending_word(i) : 0);
        if (bits == 0) {
            continue;
        }
        count += uint64_t(std::popcount(bits & ~dest[i]));
        dest[i] |= bits;
        if (on_word) {
            on_word(i, bits);
        }
    }
    collected_.fetch_add(taken, std::memory_order_relaxed);
    return count;
}

bool DirtyBitmap::sync_to_pending()
{
    uint64_t *pending = pending_.load(std::memory_order_acquire);
    if (!pending) {
        pending = static_cast<uint64_t *>(std::calloc(words_, 8));
        if (!pending) {
            return false;
        }
        pending_.store(pending, std::memory_order_release);
    }
    uint64_t taken = 0;
    for (size_t i = 0; i < words_; i++) {
        if (uint64_t bits = take_word(i)) {
            std::atomic_ref<uint64_t>(pending[i]).fetch_or(bits, std::memory_order_release);
            taken += uint64_t(std::popcount(bits));
        }
    }
    collected_.fetch_add(taken, std::memory_order_relaxed);
    if (taken) {
        // Release: pairs with the acquire in sync_and_clear().
        has_pending_.store(true, std::memory_order_release);
    }
    return true;
}

} // namespace qmigd
