// A page-aligned heap buffer for page data. O_DIRECT reads and writes
// (direct-io) need buffers aligned to the file system's block size; a page
// covers every file system qmigd writes to.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>

namespace qmigd {

class AlignedBuffer {
public:
    static constexpr size_t kAlign = 4096;

    explicit AlignedBuffer(size_t bytes)
        : p_(static_cast<uint8_t *>(std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign)))
    {
        if (!p_) {
            throw std::bad_alloc();
        }
    }
    ~AlignedBuffer() { std::free(p_); }
    AlignedBuffer(const AlignedBuffer &) = delete;
    AlignedBuffer &operator=(const AlignedBuffer &) = delete;

    uint8_t *get() const { return p_; }

private:
    uint8_t *p_;
};

} // namespace qmigd
