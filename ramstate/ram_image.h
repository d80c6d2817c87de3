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

    // Page data moves through the file (pread/pwrite), not the mapping:
    // the kernel copies via its direct map, while a process touching a
    // /dev/shm page through its own mapping for the first time pays a page
    // fault (~5-9 us each on these machines, even after MADV_POPULATE_*).
    // Measured for 256 MiB: pwrite 0.05 s, populate + memcpy 0.43 s.

    // Reads len bytes at offset (source side). Thread-safe.
    Status read(uint64_t offset, void *dst, size_t len) const;
    // Writes len bytes at offset (receive side); the pages stop being known
    // zero. Thread-safe for distinct ranges.
    Status write(uint64_t offset, const void *src, size_t len);
    // Scattered pages <-> a packed buffer (page i at buf + i * 4096), one
    // system call per run of consecutive offsets. Offsets must be valid.
    Status read_pages(const uint64_t *offsets, uint32_t n, uint8_t *buf) const;
    Status write_pages(const uint64_t *offsets, uint32_t n, const uint8_t *buf);

    // Marks which pages are holes in the file (never written, so zero).
    // Call before a migration writes into the image.
    void scan_holes();
    // A page that was a hole at scan_holes() and was not written since.
    bool known_zero(uint64_t page) const;
    // Receive side: make the page read as zeros. A page known to be a hole
    // is left alone; any other is read and, only if it holds data, punched
    // out of the file (no write, and its memory is freed). Thread-safe for
    // distinct pages.
    Status zero_page(uint64_t offset);

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
};

} // namespace qmigd
