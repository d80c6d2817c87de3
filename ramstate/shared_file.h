// A small file in shared memory that other processes map too (the dirty
// bitmap, the guest control record): created if missing, sized if empty,
// and mapped MAP_SHARED read-write. An existing file of another size is
// refused, never resized under the processes that map it.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "protocol/error.h"

namespace qmigd {

// Whose name a side file has: one the user gave is always kept; one qmigd
// derived from the image (IMAGE.dirty, IMAGE.ctl) is removed when closed if
// this process created it and no other process has it open then. An
// Anonymous one has no name at all (a memfd): for a parked VM, which no
// other process writes and whose directory qmigd must not write into.
enum class SideFileName { Named, Derived, Anonymous };

class SharedFile {
public:
    // `what` names the file in errors ("dirty bitmap", ...).
    static Result<std::unique_ptr<SharedFile>> open(const std::string &path, size_t bytes,
                                                    const char *what,
                                                    SideFileName name = SideFileName::Named);
    ~SharedFile();
    SharedFile(const SharedFile &) = delete;
    SharedFile &operator=(const SharedFile &) = delete;

    void *data() const { return data_; }
    size_t size() const { return size_; }
    const std::string &path() const { return path_; }

private:
    SharedFile() = default;

    std::string path_;
    int fd_ = -1;
    void *data_ = nullptr;
    size_t size_ = 0;
    bool remove_at_close_ = false;
};

} // namespace qmigd
