// A scratch file for measuring a file system (page paths, `qmigd limits`):
// created new under a random name (O_EXCL, so nothing planted at that name,
// a symbolic link included, is opened or truncated), unlinked at once (it
// is used through its descriptor and mappings, so a process killed while
// measuring leaves nothing behind), and sized.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace qmigd {

class ScratchFile {
public:
    ScratchFile(const std::string &dir, const char *tag, size_t bytes);
    ~ScratchFile();
    ScratchFile(const ScratchFile &) = delete;
    ScratchFile &operator=(const ScratchFile &) = delete;

    bool ok() const { return fd_ >= 0; }
    int fd() const { return fd_; }
    const std::string &path() const { return path_; }
    size_t bytes() const { return bytes_; }
    // A shared mapping of the whole file, or nullptr.
    uint8_t *map(int prot) const;

private:
    std::string path_;
    int fd_ = -1;
    size_t bytes_ = 0;
};

} // namespace qmigd
