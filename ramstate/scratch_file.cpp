// Scratch files next to an image for measuring its file system, removed however they end.
#include "ramstate/scratch_file.h"

#include <fcntl.h>
#include <random>
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

namespace qmigd {

ScratchFile::ScratchFile(const std::string &dir, const char *tag, size_t bytes) : bytes_(bytes)
{
    std::random_device rd;
    uint64_t r = (uint64_t(rd()) << 32) | rd();
    path_ = fmt::format("{}/.qmigd-{}-{}-{:016x}", dir, tag, getpid(), r);
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd_ < 0) {
        return;
    }
    // Used only through the descriptor and its mappings: unlinked at once,
    // so that a process killed mid-measurement (SIGTERM, kill -9) leaves
    // nothing behind; its memory goes with the last reference.
    unlink(path_.c_str());
    if (ftruncate(fd_, off_t(bytes)) < 0) {
        ::close(fd_);
        fd_ = -1;
    }
}

ScratchFile::~ScratchFile()
{
    if (fd_ >= 0) {
        ::close(fd_);
    }
}

uint8_t *ScratchFile::map(int prot) const
{
    void *p = mmap(nullptr, bytes_, prot, MAP_SHARED, fd_, 0);
    return p == MAP_FAILED ? nullptr : static_cast<uint8_t *>(p);
}

} // namespace qmigd
