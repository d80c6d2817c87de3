// RamImage: an image file mapped, its pages read and written by the measured page path, its holes.
#include "ramstate/ram_image.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "ramstate/full_io.h"
#include "ramstate/populate.h"
#include "ramstate/zero_page.h"


namespace qmigd {

namespace {

Error sys_error(const std::string &what, const std::string &path)
{
    return Error(fmt::format("{} '{}': {}", what, path, std::strerror(errno)));
}

std::atomic_ref<uint64_t> word_ref(std::vector<uint64_t> &bits, uint64_t i)
{
    return std::atomic_ref<uint64_t>(bits[i / 64]);
}

// Sets bits [first, end) of a bitmap, a word at a time.
void set_bits(std::vector<uint64_t> &bits, uint64_t first, uint64_t end)
{
    while (first < end) {
        uint64_t in_word = std::min<uint64_t>(64 - first % 64, end - first);
        uint64_t mask = in_word == 64 ? ~uint64_t(0) : ((uint64_t(1) << in_word) - 1);
        bits[first / 64] |= mask << (first % 64);
        first += in_word;
    }
}

alignas(4096) const uint8_t kZeroPage[TARGET_PAGE_SIZE] = {};

} // namespace

Result<std::unique_ptr<RamImage>> RamImage::open(const std::string &path, uint64_t size,
                                                 ImageOpen how)
{
    std::unique_ptr<RamImage> img(new RamImage());
    img->path_ = path;
    int nofollow = how == ImageOpen::Shared ? 0 : O_NOFOLLOW;
    bool created = false;
    if (how != ImageOpen::ReadOnly) {
        img->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | nofollow | O_CLOEXEC, 0600);
        created = img->fd_ >= 0;
    }
    if (how == ImageOpen::ReadOnly || (how == ImageOpen::Shared && !created && errno == EEXIST)) {
        // O_NONBLOCK: a FIFO planted in a parked VM's place must not hang
        // the open (a regular file ignores it).
        int mode = how == ImageOpen::ReadOnly ? O_RDONLY | O_NONBLOCK : O_RDWR;
        img->fd_ = ::open(path.c_str(), mode | nofollow | O_CLOEXEC);
    }
    if (img->fd_ < 0) {
        return sys_error(errno == ELOOP ? "refusing a symbolic link as RAM image"
                                        : "cannot open RAM image",
                         path);
    }
    auto r = img->init(size, how != ImageOpen::ReadOnly);
    if (!r.ok() && created) {
        unlink(path.c_str()); // a failed start leaves nothing behind
    }
    if (!r.ok()) {
        return r.error();
    }
    img->created_ = created;
    return img;
}

void RamImage::set_page_paths(PagePaths p)
{
    if (p.write == PageAccess::Fill && !fill_) {
        auto f = backing_.can_fill()
                     ? FillMapping::open(fd_, size_, path_)
                     : Result<std::unique_ptr<FillMapping>>(Error("not a shmem file"));
        if (f) {
            fill_ = std::move(*f);
        } else {
            p.write = p.write_without_fill;
            p.why += fmt::format("; no fill path, writes {} ({})", page_access_name(p.write),
                                 f.error().message());
        }
    }
    if (p.write != PageAccess::Fill) {
        fill_.reset();
    }
    paths_ = std::move(p);
}

Status RamImage::sync() const
{
    if (::fsync(fd_) < 0) {
        return sys_error("cannot sync RAM image", path_);
    }
    return {};
}

Status RamImage::init(uint64_t size, bool writable)
{
    const std::string &path = path_;
    struct stat st;
    if (fstat(fd_, &st) < 0) {
        return sys_error("cannot stat RAM image", path);
    }
    auto backing = backing_of(fd_, path);
    QMIGD_TRY(backing);
    backing_ = *backing;
    // hugetlbfs maps whole huge pages only; a huge tmpfs falls back to 4 KiB.
    bool huge_only = backing_.kind == BackingKind::Hugetlbfs;
    uint64_t granule = huge_only ? backing_.page_size : TARGET_PAGE_SIZE;
    uint64_t file_size = uint64_t(st.st_size);
    if (size == 0) {
        size = file_size;
        if (size == 0) {
            return Error(fmt::format("RAM image '{}' is empty; give size=BYTES", path));
        }
    }
    if (size % granule) {
        // QEMU: "backend 'memory-backend-file' memory size must be multiple of 2 MiB"
        return Error(fmt::format("RAM image '{}': memory size 0x{:x} must be multiple of {} KiB "
                                 "(the page size of its {})",
                                 path, size, granule >> 10, backing_.name()));
    }
    if (file_size && file_size < size) {
        // QEMU's memory-backend-file refuses it too; growing it would
        // rewrite a file another process may be using as guest RAM.
        return Error(fmt::format("RAM image '{}': backing store size 0x{:x} is too small for "
                                 "'size' option 0x{:x}",
                                 path, file_size, size));
    }
    if (!S_ISREG(st.st_mode)) {
        return Error(fmt::format("RAM image '{}' is not a regular file", path));
    }
    if (file_size == 0 && !writable) {
        return Error(fmt::format("RAM image '{}' is empty", path));
    }
    if (file_size == 0 && ftruncate(fd_, off_t(size)) < 0) {
        return sys_error("cannot size RAM image", path);
    }
    size_ = size;
    int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
    void *p = mmap(nullptr, size, prot, MAP_SHARED | MAP_NORESERVE, fd_, 0);
    if (p == MAP_FAILED) {
        return sys_error("cannot map RAM image", path);
    }
    base_ = static_cast<uint8_t *>(p);
    fault_size_ = backing_.page_size;
    if (backing_.kind == BackingKind::TmpfsHuge) {
        // Faulted 4 KiB at a time, as QEMU's own mapping of the file is (it
        // is not 2 MiB aligned): a huge folio for each page written would
        // hold up to 512 times the data (a destination's sparse image), and
        // each needs 2 MiB of free contiguous memory, so the time would
        // depend on how fragmented other processes left it (1 GiB mixed
        // image: 0.6 s after a qmigd run, 4.4 s after a QEMU run). Huge
        // folios already in the file are still read through this mapping.
        if (madvise(base_, size_, MADV_NOHUGEPAGE) == 0) {
            fault_size_ = TARGET_PAGE_SIZE;
        }
    }
    if (fault_size_ > TARGET_PAGE_SIZE) {
        for (auto &bits : populated_) {
            bits.assign(((size_ + fault_size_ - 1) / fault_size_ + 63) / 64, 0);
        }
    }
    return {};
}

RamImage::~RamImage()
{
    if (base_) {
        munmap(base_, size_);
    }
    if (fd_ >= 0) {
        close(fd_);
    }
}

const uint8_t *RamImage::zero_data()
{
    return kZeroPage;
}

bool RamImage::is_zero_page(const uint8_t *page)
{
    return page == kZeroPage || buffer_is_zero_page(page);
}

// Pre-faults [offset, offset + len), widened to whole fault units (a huge
// page is faulted whole anyway). Fails cleanly where a plain touch would
// SIGBUS (no free huge pages, file system full).
Status RamImage::populate(uint64_t offset, size_t len, bool write) const
{
    uint64_t g = fault_size_;
    uint64_t start = offset / g * g;
    uint64_t end = std::min(size_, (offset + len + g - 1) / g * g);
    auto &done = populated_[write];
    uint64_t first = start / g, last = (end + g - 1) / g; // backing pages [first, last)
    if (!done.empty()) {
        uint64_t i = first;
        while (i < last && (word_ref(done, i).load(std::memory_order_relaxed) >> (i % 64)) & 1) {
            i++;
        }
        if (i == last) {
            return {};
        }
    }
    if (madvise(base_ + start, end - start, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0) {
        for (uint64_t i = first; !done.empty() && i < last; i++) {
            word_ref(done, i).fetch_or(uint64_t(1) << (i % 64), std::memory_order_relaxed);
            if (write) { // writable implies readable
                word_ref(populated_[0], i).fetch_or(uint64_t(1) << (i % 64),
                                                    std::memory_order_relaxed);
            }
        }
        return {};
    }
    return Error(fmt::format("cannot fault in RAM image '{}' at 0x{:x}+0x{:x}: {}{}", path_, start,
                             end - start, std::strerror(errno),
                             backing_.kind == BackingKind::Hugetlbfs ? " (no free huge pages?)"
                                                                     : ""));
}

// Calls fn(first index, pages) for each run of consecutive page offsets
// among those keep(i) accepts.
template <typename Keep, typename Fn>
static Status for_each_run(const uint64_t *offsets, uint32_t n, Keep keep, Fn fn)
{
    uint32_t i = 0;
    while (i < n) {
        if (!keep(i)) {
            i++;
            continue;
        }
        uint32_t run = 1;
        while (i + run < n && offsets[i + run] == offsets[i] + run * TARGET_PAGE_SIZE &&
               keep(i + run)) {
            run++;
        }
        QMIGD_TRY(fn(i, run));
        i += run;
    }
    return {};
}

void RamImage::clear_known_zero(uint64_t offset, size_t len)
{
    if (known_zero_.empty() || len == 0) {
        return;
    }
    for (uint64_t pg = offset >> TARGET_PAGE_BITS; pg <= (offset + len - 1) >> TARGET_PAGE_BITS;
         pg++) {
        word_ref(known_zero_, pg).fetch_and(~(uint64_t(1) << (pg % 64)), std::memory_order_relaxed);
    }
}

Status RamImage::read(uint64_t offset, void *dst, size_t len) const
{
    if (paths_.read == PageAccess::Mapped) {
        QMIGD_TRY(populate(offset, len, false));
        std::memcpy(dst, base_ + offset, len);
        return {};
    }
    auto *out = static_cast<uint8_t *>(dst);
    return full_io(path_, "read", offset, len, [&](size_t done, size_t left, off_t at) {
        return pread(fd_, out + done, left, at);
    });
}

Status RamImage::write(uint64_t offset, const void *src, size_t len)
{
    clear_known_zero(offset, len);
    if (paths_.write == PageAccess::Mapped) {
        QMIGD_TRY(populate(offset, len, true));
        std::memcpy(base_ + offset, src, len);
        return {};
    }
    auto *in = static_cast<const uint8_t *>(src);
    if (paths_.write == PageAccess::Fill && (offset | len) % TARGET_PAGE_SIZE == 0) {
        return fill_->store(offset, in, len);
    }
    return full_io(path_, "write", offset, len, [&](size_t done, size_t left, off_t at) {
        return pwrite(fd_, in + done, left, at);
    });
}

Status RamImage::load_pages(const uint64_t *offsets, uint32_t n, uint8_t *buf,
                            const uint8_t **where) const
{
    auto not_hole = [&](uint32_t i) { return !known_zero(offsets[i] >> TARGET_PAGE_BITS); };
    for (uint32_t i = 0; i < n; i++) {
        where[i] = kZeroPage;
    }
    return for_each_run(offsets, n, not_hole, [&](uint32_t i, uint32_t run) -> Status {
        size_t len = size_t(run) * TARGET_PAGE_SIZE;
        if (paths_.read == PageAccess::Mapped) {
            QMIGD_TRY(populate(offsets[i], len, false));
            for (uint32_t k = 0; k < run; k++) {
                where[i + k] = base_ + offsets[i] + size_t(k) * TARGET_PAGE_SIZE;
            }
            return {};
        }
        uint8_t *dst = buf + size_t(i) * TARGET_PAGE_SIZE;
        for (uint32_t k = 0; k < run; k++) {
            where[i + k] = dst + size_t(k) * TARGET_PAGE_SIZE;
        }
        return full_io(path_, "read", offsets[i], len, [&](size_t done, size_t left, off_t at) {
            return pread(fd_, dst + done, left, at);
        });
    });
}

Status RamImage::prepare_pages(const uint64_t *offsets, uint32_t n, uint8_t *buf,
                               struct iovec *iov, int *niov)
{
    bool mapped = paths_.write == PageAccess::Mapped;
    *niov = 0;
    auto all = [](uint32_t) { return true; };
    return for_each_run(offsets, n, all, [&](uint32_t i, uint32_t run) -> Status {
        size_t len = size_t(run) * TARGET_PAGE_SIZE;
        if (mapped) {
            clear_known_zero(offsets[i], len);
            QMIGD_TRY(populate(offsets[i], len, true));
        }
        iov[(*niov)++] = {mapped ? base_ + offsets[i] : buf + size_t(i) * TARGET_PAGE_SIZE, len};
        return {};
    });
}

Result<uint8_t *> RamImage::writable_range(uint64_t offset, size_t len)
{
    if (offset > size_ || len > size_ - offset) {
        return Error(fmt::format("RAM image '{}': range 0x{:x}+0x{:x} is outside it", path_,
                                 offset, len));
    }
    clear_known_zero(offset, len);
    QMIGD_TRY(populate(offset, len, true));
    return base_ + offset;
}

void RamImage::allocate(uint64_t offset, size_t len)
{
    if (backing_.kind == BackingKind::Tmpfs && offset <= size_ && len <= size_ - offset) {
        (void)::fallocate(fd_, FALLOC_FL_KEEP_SIZE, off_t(offset), off_t(len));
    }
}

Status RamImage::commit_pages(const uint64_t *offsets, uint32_t n, const uint8_t *buf)
{
    if (paths_.write == PageAccess::Mapped) {
        return {}; // received in place
    }
    // pwrite serialises on the inode lock anyway; queueing here instead
    // lets the waiting receive threads sleep rather than spin in the kernel
    // (rwsem_spin_on_owner, a fifth of the CPU with 4 channels). Fills take
    // no lock and run side by side.
    std::unique_lock<std::mutex> lk(pwrite_mu_, std::defer_lock);
    if (paths_.write == PageAccess::File) {
        lk.lock();
    }
    auto all = [](uint32_t) { return true; };
    return for_each_run(offsets, n, all, [&](uint32_t i, uint32_t run) {
        return write(offsets[i], buf + size_t(i) * TARGET_PAGE_SIZE, size_t(run) * TARGET_PAGE_SIZE);
    });
}

void RamImage::scan_holes()
{
    known_zero_.assign((pages() + 63) / 64, 0);
    // A file with no blocks is one hole. This is the only hole hugetlbfs can
    // show (it has no SEEK_HOLE, but counts its huge pages in st_blocks), and
    // it spares a fresh destination from faulting in every zero page.
    struct stat st;
    if (fstat(fd_, &st) == 0 && st.st_blocks == 0) {
        set_bits(known_zero_, 0, pages());
        return;
    }
    if (!backing_.seeks_holes()) {
        return;
    }
    off_t pos = 0;
    while (uint64_t(pos) < size_) {
        off_t hole = lseek(fd_, pos, SEEK_HOLE);
        if (hole < 0 || uint64_t(hole) >= size_) {
            break;
        }
        off_t data = lseek(fd_, hole, SEEK_DATA);
        uint64_t end = data < 0 ? size_ : std::min(size_, uint64_t(data));
        set_bits(known_zero_, (uint64_t(hole) + TARGET_PAGE_SIZE - 1) >> TARGET_PAGE_BITS,
                 end >> TARGET_PAGE_BITS);
        if (data < 0) {
            break;
        }
        pos = data;
    }
}

bool RamImage::known_zero(uint64_t page) const
{
    return known_zero_word(page / 64) & (uint64_t(1) << (page % 64));
}

uint64_t RamImage::known_zero_word(size_t word) const
{
    if (known_zero_.empty()) {
        return 0;
    }
    return std::atomic_ref<const uint64_t>(known_zero_[word]).load(std::memory_order_relaxed);
}

void RamImage::forget_holes(size_t word, uint64_t dirty)
{
    if (word < known_zero_.size()) {
        word_ref(known_zero_, word * 64).fetch_and(~dirty, std::memory_order_relaxed);
    }
}

Status RamImage::zero_page(uint64_t offset)
{
    if (known_zero(offset >> TARGET_PAGE_BITS)) {
        return {};
    }
    alignas(64) uint8_t page[TARGET_PAGE_SIZE];
    const uint8_t *where = nullptr;
    QMIGD_TRY(load_pages(&offset, 1, page, &where));
    if (buffer_is_zero_page(where)) {
        return {};
    }
    if (backing_.punch_4k() &&
        fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off_t(offset),
                  off_t(TARGET_PAGE_SIZE)) == 0) {
        return {};
    }
    // No 4 KiB holes here (huge pages, or no hole punching): write zeros.
    return write(offset, kZeroPage, TARGET_PAGE_SIZE);
}

} // namespace qmigd
