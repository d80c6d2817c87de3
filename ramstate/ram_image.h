// A RAM image: the raw bytes of one RAMBlock in a shared file, mapped
// MAP_SHARED exactly as QEMU's memory-backend-file,share=on maps them.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "protocol/error.h"
#include "protocol/qemu_format.h"

namespace qmigd {

class RamImage {
public:
    // Opens (or creates) path. size == 0 means "use the file's size"; a
    // missing file needs a size. Grows or checks the file to size.
    static Result<std::unique_ptr<RamImage>> open(const std::string &path, uint64_t size);
    ~RamImage();
    RamImage(const RamImage &) = delete;
    RamImage &operator=(const RamImage &) = delete;

    uint64_t size() const { return size_; }
    uint64_t pages() const { return size_ >> TARGET_PAGE_BITS; }
    uint8_t *host(uint64_t offset) const { return base_ + offset; }
    const std::string &path() const { return path_; }

    // Send side: pre-faults the mapping of the populate chunks covering
    // [offset, offset+len) for reading, once per chunk (MADV_POPULATE_READ):
    // mapping 4 KiB pages one fault at a time costs ~5 us each here, in bulk
    // ~0.1 us. Call from one thread.
    void prepare_read(uint64_t offset, uint64_t len);

    // Marks which pages are holes in the file (never written, so zero).
    // Call before a migration writes into the image.
    void scan_holes();
    // A page that was a hole at scan_holes() and was not written since.
    bool known_zero(uint64_t page) const;
    // Receive side: [offset, offset+len) is about to be written: its pages
    // stop being known zero and are pre-faulted writable in one call
    // (MADV_POPULATE_WRITE). Exactly the range, not a chunk around it: a
    // fresh shmem page costs an allocation, and zero pages need none.
    // Thread-safe for distinct ranges.
    void prepare_write(uint64_t offset, uint64_t len);
    // Receive side: make the page read as zeros, writing only if it is not
    // already zero. Thread-safe for distinct pages.
    void zero_page(uint64_t offset);

private:
    RamImage() = default;

    std::string path_;
    int fd_ = -1;
    uint8_t *base_ = nullptr;
    uint64_t size_ = 0;
    // One bit per page: set while the page is a hole. Words are updated with
    // atomic fetch_and from the receive threads (each page by one writer per
    // epoch; atomics because neighbours share a word).
    std::vector<uint64_t> known_zero_;
    // Send side, one bit per populate chunk: set once pre-faulted.
    std::vector<uint64_t> populated_;
};

} // namespace qmigd
