// A destination's third page path: new pages of a shared-memory image made
// already holding the received bytes (userfaultfd's UFFDIO_COPY), where a
// pwrite serialises the receive threads on the file's inode lock and a
// fault through the mapping first clears every page it allocates.
//
// The image is mapped a second time and that mapping registered with a
// userfaultfd for missing pages; nothing ever reads or writes through it.
// UFFDIO_COPY allocates a page, copies the bytes in and adds it to the
// file, from any number of threads at once, with no clearing and no inode
// lock. A page the file already holds answers EEXIST; it and the held
// pages right after it are written with one pwrite. The image's own mapping is not registered, so every
// other access to the image (the source's reads, a later QEMU) is as
// before. Only shmem files (tmpfs, 4 KiB pages on a huge-page tmpfs too:
// UFFDIO_COPY makes small pages) can be filled this way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "protocol/error.h"

namespace qmigd {

class FillMapping {
public:
    // A fill mapping of [0, size) of `fd` (a shmem file open for writing).
    // Fails where userfaultfd cannot be had (an old kernel, a file system
    // other than shmem, a seccomp filter without it).
    static Result<std::unique_ptr<FillMapping>> open(int fd, uint64_t size,
                                                     const std::string &path);
    ~FillMapping();
    FillMapping(const FillMapping &) = delete;
    FillMapping &operator=(const FillMapping &) = delete;

    // Stores len bytes (whole pages) at offset: new pages by UFFDIO_COPY,
    // pages the file already holds by pwrite. Thread-safe for distinct
    // ranges.
    Status store(uint64_t offset, const uint8_t *src, size_t len);

private:
    FillMapping() = default;
    Status overwrite_held(uint64_t offset, const uint8_t *src, size_t len, size_t *done);
    Status store_error(uint64_t offset, int err) const;

    int fd_ = -1;   // the image's, borrowed
    int uffd_ = -1; // owned
    uint8_t *base_ = nullptr;
    uint64_t size_ = 0;
    std::string path_;
};

} // namespace qmigd
