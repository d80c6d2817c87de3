#include "ramstate/ram_image.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

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

} // namespace

Result<std::unique_ptr<RamImage>> RamImage::open(const std::string &path, uint64_t size)
{
    if (size % TARGET_PAGE_SIZE) {
        return Error(fmt::format("RAM image '{}': size {} is not a multiple of {}", path, size,
                                 TARGET_PAGE_SIZE));
    }
    std::unique_ptr<RamImage> img(new RamImage());
    img->path_ = path;
    img->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (img->fd_ < 0) {
        return sys_error("cannot open RAM image", path);
    }
    struct stat st;
    if (fstat(img->fd_, &st) < 0) {
        return sys_error("cannot stat RAM image", path);
    }
    uint64_t file_size = uint64_t(st.st_size);
    if (size == 0) {
        if (file_size == 0 || file_size % TARGET_PAGE_SIZE) {
            return Error(fmt::format("RAM image '{}': size {} is not a positive multiple of "
                                     "{}; give size=BYTES",
                                     path, file_size, TARGET_PAGE_SIZE));
        }
        size = file_size;
    } else if (file_size > size) {
        return Error(fmt::format("RAM image '{}' is larger ({} bytes) than size={}", path,
                                 file_size, size));
    } else if (file_size < size && ftruncate(img->fd_, off_t(size)) < 0) {
        return sys_error("cannot size RAM image", path);
    }
    img->size_ = size;
    void *p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, img->fd_, 0);
    if (p == MAP_FAILED) {
        return sys_error("cannot map RAM image", path);
    }
    img->base_ = static_cast<uint8_t *>(p);
    return img;
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

// Runs a pread/pwrite-style call until all len bytes moved.
template <typename Io>
static Status full_io(const std::string &path, const char *what, uint64_t offset, size_t len,
                      Io io)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = io(done, len - done, off_t(offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return Error(fmt::format("{} of RAM image '{}' at 0x{:x} failed: {}", what, path,
                                     offset + done, n < 0 ? std::strerror(errno) : "short"));
        }
        done += size_t(n);
    }
    return {};
}

// Calls fn(first index, pages) for each run of consecutive page offsets.
template <typename Fn>
static Status for_each_run(const uint64_t *offsets, uint32_t n, Fn fn)
{
    uint32_t i = 0;
    while (i < n) {
        uint32_t run = 1;
        while (i + run < n && offsets[i + run] == offsets[i] + run * TARGET_PAGE_SIZE) {
            run++;
        }
        QMIGD_TRY(fn(i, run));
        i += run;
    }
    return {};
}

Status RamImage::read(uint64_t offset, void *dst, size_t len) const
{
    auto *out = static_cast<uint8_t *>(dst);
    return full_io(path_, "read", offset, len, [&](size_t done, size_t left, off_t at) {
        return pread(fd_, out + done, left, at);
    });
}

Status RamImage::write(uint64_t offset, const void *src, size_t len)
{
    if (!known_zero_.empty()) {
        for (uint64_t pg = offset >> TARGET_PAGE_BITS; pg <= (offset + len - 1) >> TARGET_PAGE_BITS;
             pg++) {
            word_ref(known_zero_, pg).fetch_and(~(uint64_t(1) << (pg % 64)),
                                                std::memory_order_relaxed);
        }
    }
    auto *in = static_cast<const uint8_t *>(src);
    return full_io(path_, "write", offset, len, [&](size_t done, size_t left, off_t at) {
        return pwrite(fd_, in + done, left, at);
    });
}

Status RamImage::read_pages(const uint64_t *offsets, uint32_t n, uint8_t *buf) const
{
    return for_each_run(offsets, n, [&](uint32_t i, uint32_t run) {
        return read(offsets[i], buf + size_t(i) * TARGET_PAGE_SIZE, size_t(run) * TARGET_PAGE_SIZE);
    });
}

Status RamImage::write_pages(const uint64_t *offsets, uint32_t n, const uint8_t *buf)
{
    return for_each_run(offsets, n, [&](uint32_t i, uint32_t run) {
        return write(offsets[i], buf + size_t(i) * TARGET_PAGE_SIZE, size_t(run) * TARGET_PAGE_SIZE);
    });
}

void RamImage::scan_holes()
{
    known_zero_.assign((pages() + 63) / 64, 0);
    off_t pos = 0;
    while (uint64_t(pos) < size_) {
        off_t hole = lseek(fd_, pos, SEEK_HOLE);
        if (hole < 0 || uint64_t(hole) >= size_) {
            break;
        }
        off_t data = lseek(fd_, hole, SEEK_DATA);
        uint64_t end = data < 0 ? size_ : uint64_t(data);
        uint64_t first = (uint64_t(hole) + TARGET_PAGE_SIZE - 1) >> TARGET_PAGE_BITS;
        for (uint64_t pg = first; pg < (end >> TARGET_PAGE_BITS); pg++) {
            known_zero_[pg / 64] |= uint64_t(1) << (pg % 64);
        }
        if (data < 0) {
            break;
        }
        pos = data;
    }
}

bool RamImage::known_zero(uint64_t page) const
{
    if (known_zero_.empty()) {
        return false;
    }
    auto w = std::atomic_ref<const uint64_t>(known_zero_[page / 64]).load(std::memory_order_relaxed);
    return w & (uint64_t(1) << (page % 64));
}

Status RamImage::zero_page(uint64_t offset)
{
    if (known_zero(offset >> TARGET_PAGE_BITS)) {
        return {};
    }
    alignas(64) uint8_t page[TARGET_PAGE_SIZE];
    QMIGD_TRY(read(offset, page, sizeof(page)));
    if (buffer_is_zero_page(page)) {
        return {};
    }
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off_t(offset),
                  off_t(TARGET_PAGE_SIZE)) == 0) {
        return {};
    }
    // No hole punching on this file system: write the zeros.
    std::memset(page, 0, sizeof(page));
    return write(offset, page, sizeof(page));
}

} // namespace qmigd
