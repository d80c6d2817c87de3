// The shared dirty bitmap of one RAMBlock (format: ramstate/README.md).
//
// Writers (the guest, or `qmigd guest`) set a page's bit with an atomic
// OR after writing the page. The migration source collects bits with an
// atomic exchange of each word to zero (get-and-clear, like KVM's dirty
// log), so a write that races with a sync is seen by this sync or the next.
#pragma once

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

private:
    DirtyBitmap() = default;

    std::unique_ptr<SharedFile> file_;
    uint64_t *bits_ = nullptr; // in file_, shared with other processes: atomic access only
    uint64_t pages_ = 0;
    size_t words_ = 0;
};

// Bytes of a bitmap file for `pages` pages: whole 64-bit words.
inline size_t dirty_bitmap_bytes(uint64_t pages) { return size_t((pages + 63) / 64) * 8; }

} // namespace qmigd
