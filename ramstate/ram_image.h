// A RAM image: the raw bytes of one RAMBlock in a shared file, mapped
// MAP_SHARED exactly as QEMU's memory-backend-file,share=on maps them.
//
// Page data moves by one of two paths per direction (ramstate/page_path.h),
// chosen per image at start-up: through the file (pread/pwrite) or through
// the mapping. Callers see one interface either way.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <sys/uio.h>
#include <vector>

#include "protocol/error.h"
#include "protocol/qemu_format.h"
#include "ramstate/backing.h"
#include "ramstate/fill_mapping.h"
#include "ramstate/page_path.h"

namespace qmigd {

// How an image file is opened.
//  - Shared:   QEMU's memory-backend-file: opened, or created if missing.
//  - Create:   a new file only (O_EXCL), never through a symlink: a park's
//              images, in a directory someone else may write into.
//  - ReadOnly: an existing file, never through a symlink, mapped read-only:
//              a parked VM's images, which a resume must not change.
enum class ImageOpen { Shared, Create, ReadOnly };

class RamImage {
public:
    // Opens (or creates) path, as QEMU's memory-backend-file does: size == 0
    // means "use the file's size"; an empty or missing file is sized to
    // `size`; a smaller non-empty file is refused; a larger one is used for
    // its first `size` bytes. Starts with the File paths (set_page_paths).
    static Result<std::unique_ptr<RamImage>> open(const std::string &path, uint64_t size,
                                                  ImageOpen how = ImageOpen::Shared);
    ~RamImage();
    RamImage(const RamImage &) = delete;
    RamImage &operator=(const RamImage &) = delete;

    uint64_t size() const { return size_; }
    uint64_t pages() const { return size_ >> TARGET_PAGE_BITS; }
    uint8_t *host(uint64_t offset) const { return base_ + offset; }
    const std::string &path() const { return path_; }
    // This open created the file (it was not there): a start that fails
    // after it removes the file again (ram_blocks_remove_created()).
    bool created() const { return created_; }
    const Backing &backing() const { return backing_; }
    const PagePaths &page_paths() const { return paths_; }
    // Before any migration uses the image. A Fill write path that cannot be
    // had here (FillMapping::open failed) falls back to File (Mapped where
    // there is no pwrite), and p.why says so.
    void set_page_paths(PagePaths p);

    // Reads/writes len bytes at offset through the chosen path. Thread-safe
    // for distinct ranges; write() makes the pages stop being known zero.
    Status read(uint64_t offset, void *dst, size_t len) const;
    Status write(uint64_t offset, const void *src, size_t len);

    // --- source ---
    // Makes n pages readable and sets where[i] to page i's bytes: in the
    // mapping, in buf (page i at buf + i * 4096), or, for a page known to be
    // zero, in a shared zero page (is_zero_data() tells). Offsets must be
    // valid. One system call per run of consecutive pages.
    Status load_pages(const uint64_t *offsets, uint32_t n, uint8_t *buf,
                      const uint8_t **where) const;
    static const uint8_t *zero_data();
    // Whether a page load_pages() handed out reads as zero (the shared zero
    // page without looking, anything else by its bytes).
    static bool is_zero_page(const uint8_t *page);

    // --- destination ---
    // Where to receive the data of n pages: iov[0..*niov) in the mapping
    // (pre-faulted) or in buf. After the bytes are there, commit_pages()
    // stores them (a pwrite or a fill when they went into buf).
    Status prepare_pages(const uint64_t *offsets, uint32_t n, uint8_t *buf, struct iovec *iov,
                         int *niov);
    Status commit_pages(const uint64_t *offsets, uint32_t n, const uint8_t *buf);
    // [offset, offset + len) of the mapping, pre-faulted for writing,
    // whatever the page path: for a caller that fills it with a file read,
    // which is one kernel copy with its faults taken inside the kernel
    // (mapped-ram loads).
    Result<uint8_t *> writable_range(uint64_t offset, size_t len);
    // 4 KiB tmpfs: allocates [offset, offset + len) through the file, from
    // one thread, before writable_range() maps it. Allocating shmem pages
    // with fallocate and then mapping them cost a third of populating the
    // mapping alone here (PVM guest, 1.2 GiB: 0.26 s vs 0.33-1.0 s); from
    // several threads at once both serialise on the file. Best effort:
    // writable_range() reports what fails.
    void allocate(uint64_t offset, size_t len);
    // Makes the page read as zeros. A page known to be a hole is left alone;
    // any other is read and, only if it holds data, punched out of the file
    // (or cleared where 4 KiB holes cannot be punched).
    Status zero_page(uint64_t offset);

    // Data and size on stable storage (fsync), for a destination that is
    // about to report the image complete.
    Status sync() const;

    // --- holes (pages never written, so zero) ---
    // Learns them from the file (SEEK_HOLE). Source: after the first dirty
    // sync, so a write racing the scan is dirty again later.
    void scan_holes();
    // A page that was a hole at scan_holes() and was not written since.
    bool known_zero(uint64_t page) const;
    // 64 bits of known_zero() for pages [64 * word, 64 * word + 64).
    uint64_t known_zero_word(size_t word) const;
    // Source, at each dirty sync: pages the guest wrote (the bits of bitmap
    // word `word`) are no longer holes.
    void forget_holes(size_t word, uint64_t dirty);

private:
    RamImage() = default;
    Status init(uint64_t size, bool writable);
    Status populate(uint64_t offset, size_t len, bool write) const;
    void clear_known_zero(uint64_t offset, size_t len);

    std::string path_;
    int fd_ = -1;
    bool created_ = false;
    uint8_t *base_ = nullptr;
    uint64_t size_ = 0;
    Backing backing_;
    // What one fault of the mapping allocates: the backing's page size, but
    // 4 KiB on huge-page tmpfs (see init()). Set once at open.
    uint64_t fault_size_ = TARGET_PAGE_SIZE;
    PagePaths paths_;
    // The Fill write path's mapping, while paths_.write is Fill.
    std::unique_ptr<FillMapping> fill_;
    // One bit per page: set while the page is a hole. Words are updated with
    // atomic fetch_and from the receive threads (each page by one writer per
    // epoch; atomics because neighbours share a word) and, on the source, by
    // the migration thread at dirty sync while sender threads read them.
    std::vector<uint64_t> known_zero_;
    // Huge-page faults only (hugetlbfs): one bit per huge page already faulted in,
    // [0] for reading, [1] for writing, so the send and receive threads ask
    // the kernel once per huge page, not once per run of 4 KiB pages (those
    // madvise calls were a quarter of a hugetlbfs receiver's CPU). Atomic
    // fetch_or from any thread; a race costs one redundant madvise.
    mutable std::vector<uint64_t> populated_[2];
    // Held by a receive thread across its pwrites of one packet (File path).
    std::mutex pwrite_mu_;
};

} // namespace qmigd
