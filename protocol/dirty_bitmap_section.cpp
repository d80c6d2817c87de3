// Encoding and decoding of the "dirty-bitmap" iterable section's body.
#include "protocol/dirty_bitmap_section.h"

#include <fmt/format.h>

#include "protocol/wire.h"

namespace qmigd {

namespace {

enum : uint32_t {
    FLAG_EOS = 0x01,
    FLAG_ZEROES = 0x02,
    FLAG_BITMAP_NAME = 0x04,
    FLAG_DEVICE_NAME = 0x08,
    FLAG_START = 0x10,
    FLAG_COMPLETE = 0x20,
    FLAG_BITS = 0x40,
    FLAG_EXTRA = 0x80,
    START_FLAG_RESERVED = 0xf8,
};
// CHUNK_SIZE x 10: the largest bits buffer QEMU takes.
constexpr uint64_t kMaxBitsBuffer = 10 * 1024;

// Reads through f, copying into keep as it goes, while keep stays within
// max bytes: what would not fit is read through and marked over().
class Copier {
public:
    Copier(QEMUFileReader &f, std::vector<uint8_t> *keep, size_t max)
        : f_(f), keep_(keep), max_(max)
    {
    }
    uint8_t u8()
    {
        uint8_t v = f_.get_byte();
        if (fits(1)) {
            keep_->push_back(v);
        }
        return v;
    }
    uint16_t be16() { return uint16_t(u8() << 8 | u8()); }
    uint32_t be32() { return uint32_t(be16()) << 16 | be16(); }
    uint64_t be64() { return uint64_t(be32()) << 32 | be32(); }
    void bytes(size_t n)
    {
        if (!fits(n)) {
            f_.skip(n);
            return;
        }
        size_t at = keep_->size();
        keep_->resize(at + n);
        f_.get_buffer(keep_->data() + at, n);
    }
    bool failed() const { return f_.failed(); }
    bool over() const { return over_; }

private:
    bool fits(size_t n)
    {
        if (!keep_ || over_) {
            return false;
        }
        over_ = keep_->size() > max_ || n > max_ - keep_->size();
        if (!over_ && keep_->size() + n > kReserveAt && keep_->capacity() < max_) {
            // Past 1 MiB (a few disks' bitmaps are KiB), room for the most
            // it may keep, once: reserved address space costs no memory
            // until written, and no doubling leaves copies in the heap.
            keep_->reserve(max_);
        }
        return !over_;
    }

    static constexpr size_t kReserveAt = 1 << 20;
    QEMUFileReader &f_;
    std::vector<uint8_t> *keep_;
    size_t max_;
    bool over_ = false;
};

// qemu_get_bitmap_flags(): 8, 16 or 32 bits.
uint32_t get_flags(Copier &c)
{
    uint32_t flags = c.u8();
    if (flags & FLAG_EXTRA) {
        flags = flags << 8 | c.u8();
        if (flags & FLAG_EXTRA) {
            flags = flags << 16 | c.be16();
        }
    }
    return flags;
}

} // namespace

Status dirty_bitmap_section_read(QEMUFileReader &f, std::vector<uint8_t> *keep, size_t max_keep)
{
    Copier c(f, keep, max_keep);
    for (;;) {
        uint32_t flags = get_flags(c);
        if (flags & FLAG_DEVICE_NAME) {
            c.bytes(c.u8());
        }
        if (flags & FLAG_BITMAP_NAME) {
            c.bytes(c.u8());
        }
        if (flags & FLAG_START) {
            c.be32(); // granularity
            uint8_t start_flags = c.u8();
            if (start_flags & START_FLAG_RESERVED) {
                return Error(fmt::format("Unknown flags in migrated dirty bitmap header: {:x}",
                                         start_flags));
            }
        } else if (flags & FLAG_BITS) {
            c.be64();
            c.be32();
            if (!(flags & FLAG_ZEROES)) {
                uint64_t size = c.be64();
                if (c.failed()) {
                    break;
                }
                if (size > kMaxBitsBuffer) {
                    return Error("Bitmap migration stream buffer allocation request is too large");
                }
                c.bytes(size_t(size));
            }
        }
        if (c.failed()) {
            break;
        }
        if (flags & FLAG_EOS) {
            return {};
        }
        // Checked as it fills, not at the end: a section that never ends
        // must not grow us with the stream.
        if (c.over()) {
            return Error(fmt::format("dirty-bitmap section: more than {} bytes to keep",
                                     max_keep));
        }
    }
    return Error(f.error()).prepend("dirty-bitmap section: ");
}

} // namespace qmigd
