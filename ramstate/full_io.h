// Runs a pread/pwrite-style call until every byte moved: the loop the
// image's file paths share.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <sys/types.h>

#include <fmt/format.h>

#include "protocol/error.h"

namespace qmigd {

// io(done, left, at) moves up to `left` bytes at file offset `at` and
// returns what read/write(2) would; EINTR is retried, a short 0 is an error
// naming `what`, the image and the offset it stopped at.
template <typename Io>
Status full_io(const std::string &path, const char *what, uint64_t offset, size_t len, Io io)
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

} // namespace qmigd
