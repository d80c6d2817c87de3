// FillMapping: a second, userfaultfd-registered mapping of an image that only UFFDIO_COPY writes.
#include "ramstate/fill_mapping.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>

#include "protocol/qemu_format.h"
#include "ramstate/full_io.h"

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1 // Linux 5.11
#endif

namespace qmigd {

namespace {

Error fill_error(const char *what, const std::string &path, int err)
{
    return Error(fmt::format("{} for RAM image '{}': {}", what, path, std::strerror(err)));
}

} // namespace

Result<std::unique_ptr<FillMapping>> FillMapping::open(int fd, uint64_t size,
                                                       const std::string &path)
{
    std::unique_ptr<FillMapping> f(new FillMapping());
    f->fd_ = fd;
    f->size_ = size;
    f->path_ = path;
    // User-mode faults only: the one mode an unprivileged process may ask
    // for whatever vm.unprivileged_userfaultfd says, and no fault on this
    // mapping is ever handled anyway.
    f->uffd_ = int(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
    if (f->uffd_ < 0) {
        return fill_error("userfaultfd", path, errno);
    }
    // SIGBUS: a stray touch of the fill mapping would otherwise wait
    // forever for a handler that does not exist.
    struct uffdio_api api = {};
    api.api = UFFD_API;
    api.features = UFFD_FEATURE_SIGBUS;
    if (ioctl(f->uffd_, UFFDIO_API, &api) < 0) {
        return fill_error("UFFDIO_API", path, errno);
    }
    void *p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) {
        return fill_error("cannot map", path, errno);
    }
    f->base_ = static_cast<uint8_t *>(p);
    struct uffdio_register reg = {};
    reg.range.start = uint64_t(uintptr_t(f->base_));
    reg.range.len = size;
    reg.mode = UFFDIO_REGISTER_MODE_MISSING;
    if (ioctl(f->uffd_, UFFDIO_REGISTER, &reg) < 0) {
        return fill_error("UFFDIO_REGISTER", path, errno);
    }
    if (!(reg.ioctls & (uint64_t(1) << _UFFDIO_COPY))) {
        return Error(fmt::format("UFFDIO_COPY is not offered for RAM image '{}'", path));
    }
    return f;
}

FillMapping::~FillMapping()
{
    if (base_) {
        munmap(base_, size_);
    }
    if (uffd_ >= 0) {
        close(uffd_);
    }
}

Status FillMapping::store(uint64_t offset, const uint8_t *src, size_t len)
{
    if (offset > size_ || len > size_ - offset || (offset | len) % TARGET_PAGE_SIZE) {
        return Error(fmt::format("RAM image '{}': fill 0x{:x}+0x{:x} is outside it", path_,
                                 offset, len));
    }
    size_t done = 0;
    while (done < len) {
        struct uffdio_copy c = {};
        c.dst = uint64_t(uintptr_t(base_ + offset + done));
        c.src = uint64_t(uintptr_t(src + done));
        c.len = len - done;
        c.mode = UFFDIO_COPY_MODE_DONTWAKE; // nothing ever waits on this mapping
        int rc = ioctl(uffd_, UFFDIO_COPY, &c);
        int err = errno;
        if (c.copy > 0) {
            done += size_t(c.copy); // whole pages, up to the one that stopped it
        }
        if (rc == 0 && c.copy > 0) {
            continue;
        }
        if (rc < 0 && (err == EAGAIN || err == EINTR)) {
            continue;
        }
        if (rc < 0 && err == EEXIST) {
            // The file holds this page already (an earlier round, or an
            // image that had data): overwrite in place the pages it holds
            // from here, in one pwrite, up to the next one it does not. (A
            // pwrite into a hole would allocate a huge folio on a huge-page
            // tmpfs.)
            QMIGD_TRY(overwrite_held(offset + done, src + done, len - done, &done));
            continue;
        }
        return store_error(offset + done, rc < 0 ? err : EIO);
    }
    return {};
}

// [offset, offset+len) starts with a page the file holds: writes the pages
// it holds from there (at least that one, at most kHeldScan) and adds them to
// *done. mincore asks the page cache about just these pages (SEEK_HOLE would
// walk the file to its next hole, to its end in a full image).
Status FillMapping::overwrite_held(uint64_t offset, const uint8_t *src, size_t len, size_t *done)
{
    constexpr size_t kHeldScan = 256;
    unsigned char held[kHeldScan];
    size_t pages = std::min(len / TARGET_PAGE_SIZE, kHeldScan);
    size_t n = 1;
    if (mincore(base_ + offset, pages * TARGET_PAGE_SIZE, held) == 0) {
        while (n < pages && (held[n] & 1)) {
            n++;
        }
    }
    n *= TARGET_PAGE_SIZE;
    QMIGD_TRY(full_io(path_, "write", offset, n, [&](size_t put, size_t left, off_t at) {
        return pwrite(fd_, src + put, left, at);
    }));
    *done += n;
    return {};
}

Status FillMapping::store_error(uint64_t offset, int err) const
{
    const char *hint = "";
    struct stat st{};
    if (err == ENOMEM || err == ENOSPC) {
        hint = " (is its file system full?)"; // a full tmpfs answers ENOMEM here
    } else if (err == EFAULT && fstat(fd_, &st) == 0 && uint64_t(st.st_size) < size_) {
        hint = " (the file was truncated under it)";
    }
    return Error(fmt::format("cannot store pages of RAM image '{}' at 0x{:x}: {}{}", path_, offset,
                             std::strerror(err), hint));
}

} // namespace qmigd
