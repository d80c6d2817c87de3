// A small shared file: created or opened, sized and mapped.
#include "ramstate/shared_file.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

namespace qmigd {

Result<std::unique_ptr<SharedFile>> SharedFile::open(const std::string &path, size_t bytes,
                                                     const char *what, SideFileName name)
{
    std::unique_ptr<SharedFile> f(new SharedFile());
    f->path_ = path;
    auto fail = [&](const char *step) {
        return Error(fmt::format("cannot {} {} '{}': {}", step, what, path, std::strerror(errno)));
    };
    if (name == SideFileName::Anonymous) {
        f->fd_ = memfd_create(what, MFD_CLOEXEC);
    } else {
        f->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    }
    f->remove_at_close_ = f->fd_ >= 0 && name == SideFileName::Derived;
    if (f->fd_ < 0 && errno == EEXIST) {
        f->fd_ = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    }
    struct stat st;
    if (f->fd_ < 0 || fstat(f->fd_, &st) < 0) {
        return fail("open");
    }
    if (st.st_size != 0 && size_t(st.st_size) != bytes) {
        // Resizing it would pull pages from under other processes that map
        // it (SIGBUS): a file of another size belongs to something else.
        errno = 0;
        return Error(fmt::format("{} '{}' has {} bytes where {} are expected (left by another "
                                 "image? remove it)",
                                 what, path, st.st_size, bytes));
    }
    if (st.st_size == 0 && ftruncate(f->fd_, off_t(bytes)) < 0) {
        return fail("size");
    }
    void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f->fd_, 0);
    if (p == MAP_FAILED) {
        return fail("map");
    }
    f->data_ = p;
    f->size_ = bytes;
    return f;
}

SharedFile::~SharedFile()
{
    if (data_) {
        munmap(data_, size_);
    }
    // A write lease is granted only while no other process has the file
    // open (or mapped): then nobody uses what we created, and it can go.
    if (remove_at_close_ && fcntl(fd_, F_SETLEASE, F_WRLCK) == 0) {
        unlink(path_.c_str());
        fcntl(fd_, F_SETLEASE, F_UNLCK);
    }
    if (fd_ >= 0) {
        close(fd_);
    }
}

} // namespace qmigd
