#include "ramstate/dirty_bitmap.h"

#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

namespace qmigd {

static_assert(std::endian::native == std::endian::little,
              "the bitmap file is little-endian 64-bit words");

Result<std::unique_ptr<DirtyBitmap>> DirtyBitmap::open(const std::string &path, uint64_t pages)
{
    std::unique_ptr<DirtyBitmap> bm(new DirtyBitmap());
    bm->path_ = path;
    bm->pages_ = pages;
    bm->words_ = (pages + 63) / 64;
    size_t bytes = dirty_bitmap_bytes(pages);
    bm->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    struct stat st;
    if (bm->fd_ < 0 || fstat(bm->fd_, &st) < 0) {
        return Error(fmt::format("cannot open dirty bitmap '{}': {}", path, std::strerror(errno)));
    }
    if (size_t(st.st_size) != bytes && ftruncate(bm->fd_, off_t(bytes)) < 0) {
        return Error(fmt::format("cannot size dirty bitmap '{}': {}", path, std::strerror(errno)));
    }
    void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, bm->fd_, 0);
    if (p == MAP_FAILED) {
        return Error(fmt::format("cannot map dirty bitmap '{}': {}", path, std::strerror(errno)));
    }
    bm->bits_ = static_cast<uint64_t *>(p);
    return bm;
}

DirtyBitmap::~DirtyBitmap()
{
    if (bits_) {
        munmap(bits_, dirty_bitmap_bytes(pages_));
    }
    if (fd_ >= 0) {
        close(fd_);
    }
}

void DirtyBitmap::set_dirty(uint64_t page)
{
    // Release: pairs with the acquire in sync_and_clear(), so a source that
    // sees the bit also sees the page's new bytes.
    std::atomic_ref<uint64_t>(bits_[page / 64])
        .fetch_or(uint64_t(1) << (page % 64), std::memory_order_release);
}

uint64_t DirtyBitmap::sync_and_clear(std::vector<uint64_t> &dest)
{
    uint64_t count = 0;
    for (size_t i = 0; i < words_; i++) {
        std::atomic_ref<uint64_t> w(bits_[i]);
        // Skip clean words without a locked instruction.
        if (w.load(std::memory_order_relaxed) == 0) {
            continue;
        }
        uint64_t bits = w.exchange(0, std::memory_order_acquire);
        count += uint64_t(std::popcount(bits & ~dest[i]));
        dest[i] |= bits;
    }
    return count;
}

} // namespace qmigd
