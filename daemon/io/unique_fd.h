// UniqueFd: a file descriptor that closes itself; the one place daemon/ calls close().
//
// Move-only, as std::unique_ptr: whoever holds it owns the descriptor, a
// move hands it on, and the descriptor closes when its last owner goes. A
// descriptor shared between threads is not shared this way: one owner
// keeps it open, the others borrow get() for no longer than it lives
// (daemon/channel.h says how a migration channel does that).
#pragma once

#include <unistd.h>

#include <utility>
namespace qmigd {

class UniqueFd {
public:
    UniqueFd() = default;
    explicit UniqueFd(int fd) noexcept : fd_(fd) {}
    UniqueFd(UniqueFd &&other) noexcept : fd_(other.release()) {}
    UniqueFd &operator=(UniqueFd &&other) noexcept
    {
        reset(other.release());
        return *this;
    }
    UniqueFd(const UniqueFd &) = delete;
    UniqueFd &operator=(const UniqueFd &) = delete;
    ~UniqueFd() { reset(); }

    int get() const noexcept { return fd_; }
    bool valid() const noexcept { return fd_ >= 0; }
    explicit operator bool() const noexcept { return valid(); }

    // Gives the descriptor up without closing it (to an API that takes
    // ownership of a raw descriptor: libuv, a child process).
    int release() noexcept { return std::exchange(fd_, -1); }
    // Closes what it held and holds `fd` instead. close()'s error is not
    // reported: Linux frees the descriptor whatever it returns, and
    // retrying could close another thread's new descriptor.
    void reset(int fd = -1) noexcept
    {
        int old = std::exchange(fd_, fd);
        if (old >= 0) {
            ::close(old);
        }
    }

private:
    int fd_ = -1;
};

} // namespace qmigd
