// Postcopy's commands on the main channel (ADVISE, LISTEN, RUN, PACKAGED...): encoding and decoding.
#include "protocol/postcopy.h"

#include <algorithm>
#include <bit>

#include "protocol/qemu_format.h"

namespace qmigd {

void savevm_put_postcopy_advise(ByteWriter &w, uint64_t pagesize_summary)
{
    w.u8(QEMU_VM_COMMAND);
    w.be16(MIG_CMD_POSTCOPY_ADVISE);
    w.be16(16);
    w.be64(pagesize_summary);
    w.be64(TARGET_PAGE_SIZE);
}

// The first page at or after `from` whose bit is `set` (`pages` if none).
static uint64_t next_bit(std::span<const uint64_t> bitmap, uint64_t pages, uint64_t from, bool set)
{
    while (from < pages) {
        uint64_t word = set ? bitmap[from / 64] : ~bitmap[from / 64];
        word &= ~uint64_t(0) << (from % 64);
        if (word) {
            return std::min(pages, from / 64 * 64 + uint64_t(std::countr_zero(word)));
        }
        from = (from / 64 + 1) * 64;
    }
    return pages;
}

DiscardRanges postcopy_discard_ranges(std::span<const uint64_t> bitmap, uint64_t pages)
{
    DiscardRanges out;
    for (uint64_t one = next_bit(bitmap, pages, 0, true); one < pages;) {
        uint64_t zero = next_bit(bitmap, pages, one + 1, false);
        out.emplace_back(one * TARGET_PAGE_SIZE, (zero - one) * TARGET_PAGE_SIZE);
        one = next_bit(bitmap, pages, zero, true);
    }
    return out;
}

void savevm_put_postcopy_ram_discard(ByteWriter &w, std::string_view idstr,
                                     const DiscardRanges &ranges)
{
    for (size_t i = 0; i < ranges.size(); i += POSTCOPY_DISCARDS_PER_COMMAND) {
        size_t n = std::min(POSTCOPY_DISCARDS_PER_COMMAND, ranges.size() - i);
        w.u8(QEMU_VM_COMMAND);
        w.be16(MIG_CMD_POSTCOPY_RAM_DISCARD);
        // version, name length, name, nil, then 16 bytes a range.
        w.be16(uint16_t(3 + idstr.size() + 16 * n));
        w.u8(POSTCOPY_RAM_DISCARD_VERSION);
        w.cstr8(idstr);
        w.u8(0);
        for (size_t j = i; j < i + n; j++) {
            w.be64(ranges[j].first);
            w.be64(ranges[j].second);
        }
    }
}

void savevm_put_packaged(ByteWriter &w, std::span<const uint8_t> package)
{
    w.u8(QEMU_VM_COMMAND);
    w.be16(MIG_CMD_PACKAGED);
    w.be16(4);
    w.be32(uint32_t(package.size()));
    w.bytes(package.data(), package.size());
}

void savevm_put_recv_bitmap(ByteWriter &w, std::string_view idstr)
{
    w.u8(QEMU_VM_COMMAND);
    w.be16(MIG_CMD_RECV_BITMAP);
    w.be16(uint16_t(1 + idstr.size()));
    w.cstr8(idstr);
}

uint64_t recv_bitmap_size(uint64_t pages)
{
    return (pages + 63) / 64 * 8;
}

void rp_put_recv_bitmap_data(std::vector<uint8_t> &out, std::span<const uint64_t> bitmap,
                             uint64_t pages)
{
    ByteWriter w(out);
    uint64_t size = recv_bitmap_size(pages);
    w.be64(size);
    for (uint64_t i = 0; i < size / 8; i++) {
        uint8_t le[8];
        put_le64(le, i < bitmap.size() ? bitmap[i] : 0);
        w.bytes(le, 8);
    }
    w.be64(RAMBLOCK_RECV_BITMAP_ENDING);
}

} // namespace qmigd
