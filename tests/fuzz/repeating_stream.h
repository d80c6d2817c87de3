// A peer that never stops sending, for the fuzz targets run under memory
// limits (-rss_limit_mb, -malloc_limit_mb): the input, then its last
// bytes over and over, up to a cap past those limits. A decoder that
// buffers what it has not bounded grows until the fuzzer reports it; one
// that bounds its buffers fails or goes on in constant memory.
#pragma once

#include <algorithm>
#include <cstring>

#include "protocol/qemu_file.h"

namespace qmigd {

class RepeatingInputStream : public InputStream {
public:
    // More than -rss_limit_mb=512: an unbounded buffer shows before the end.
    static constexpr uint64_t kStreamBytes = 640ull << 20;

    // The input's last byte N says how many of the bytes before it repeat
    // (0: none, the input is the whole stream).
    RepeatingInputStream(const uint8_t *data, size_t size)
    {
        if (size == 0) {
            return;
        }
        size_t n = std::min<size_t>(data[size - 1], size - 1);
        prefix_ = data;
        prefix_len_ = size - 1;
        tail_ = data + prefix_len_ - n;
        tail_len_ = n;
    }

    ssize_t read_some(void *dst, size_t n, std::string *) override
    {
        uint8_t *out = static_cast<uint8_t *>(dst);
        if (at_ < prefix_len_) {
            size_t k = std::min<size_t>(n, prefix_len_ - at_);
            std::memcpy(out, prefix_ + at_, k);
            at_ += k;
            return ssize_t(k);
        }
        if (tail_len_ == 0 || at_ >= kStreamBytes) {
            return 0;
        }
        size_t want = size_t(std::min<uint64_t>(n, kStreamBytes - at_));
        for (size_t done = 0; done < want;) {
            size_t phase = size_t((at_ - prefix_len_) % tail_len_);
            size_t k = std::min(want - done, tail_len_ - phase);
            std::memcpy(out + done, tail_ + phase, k);
            done += k;
            at_ += k;
        }
        return ssize_t(want);
    }

private:
    const uint8_t *prefix_ = nullptr;
    size_t prefix_len_ = 0;
    const uint8_t *tail_ = nullptr;
    size_t tail_len_ = 0;
    uint64_t at_ = 0;
};

} // namespace qmigd
