// The shared dirty bitmap of one RAMBlock (format: ramstate/README.md).
//
// Writers (the guest, or `qmigd guest`) set a page's bit with an atomic
// OR after writing the page. The migration source collects bits with an
// atomic exchange of each word to zero (get-and-clear, like KVM's dirty
// log), so a write that races with a sync is seen by this sync or the next.
// calc-dirty-rate collects too, without taking bits from a migration: what
// it collects waits in a process-local bitmap that the next sync_and_clear
// takes as well (QEMU's dirty log feeding both of its dirty-memory clients).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "protocol/error.h"
#include "ramstate/shared_file.h"

namespace qmigd {

class DirtyBitmap {
public:
    // Opens or creates the bitmap file for `pages` pages.
    static Result<std::unique_ptr<DirtyBitmap>> open(const std::string &path, uint64_t pages,
                                                     SideFileName name = SideFileName::Named);
    ~DirtyBitmap();
    DirtyBitmap(const DirtyBitmap &) = delete;
    DirtyBitmap &operator=(const DirtyBitmap &) = delete;

    uint64_t pages() const { return pages_; }
    size_t words() const { return words_; }
    const std::string &path() const { return file_->path(); }

    // Writer side: mark a page dirty (after writing it).
    void set_dirty(uint64_t page);
    // Source side: moves every set bit into `dest` (OR) and clears it here.
    // Returns the number of newly collected dirty pages. `on_word`, where
    // given, sees each word's collected bits.
    uint64_t sync_and_clear(std::vector<uint64_t> &dest,
                            const std::function<void(size_t, uint64_t)> &on_word = {});
    // calc-dirty-rate's sync: takes the set bits out of the shared file
    // into the pending bitmap, where sync_and_clear finds them. Any thread;
    // one caller at a time (the dirty-rate thread). False: no memory for
    // the pending bitmap (nothing taken).
    bool sync_to_pending();
    // Pages collected out of the shared file so far by either sync, each
    // time it was found set (QEMU's total_dirty_pages): dirty-bitmap's count.
    uint64_t collected() const { return collected_.load(std::memory_order_relaxed); }

private:
    DirtyBitmap() = default;

    std::unique_ptr<SharedFile> file_;
    uint64_t *bits_ = nullptr; // in file_, shared with other processes: atomic access only
    uint64_t pages_ = 0;
    size_t words_ = 0;
    // Bits sync_to_pending() took, until sync_and_clear() takes them on:
    // allocated by the first sync_to_pending() (calloc: untouched memory
    // until a bit lands there), words accessed atomically. `has_pending_`
    // is set after bits land, so a sync that misses them sees it next time.
    std::atomic<uint64_t *> pending_{nullptr};
    std::atomic<bool> has_pending_{false};
    std::atomic<uint64_t> collected_{0};

    uint64_t take_word(size_t i);
    uint64_t take_pending_word(size_t i);
};

// Bytes of a bitmap file for `pages` pages: whole 64-bit words.
inline size_t dirty_bitmap_bytes(uint64_t pages) { return size_t((pages + 63) / 64) * 8; }

} // namespace qmigd
