// MappedRamSave: mapped-ram's page placement and file bitmaps on the source.
#include "daemon/source/mapped_ram_save.h"

#include "daemon/channel.h"

#include <sys/uio.h>

#include "daemon/socket_io.h"

namespace qmigd {

MappedRamSave::MappedRamSave(const std::vector<RAMBlock> &blocks) : blocks_(blocks.size())
{
    for (size_t i = 0; i < blocks.size(); i++) {
        blocks_[i].used_length = blocks[i].desc.used_length;
        blocks_[i].bmap = std::vector<std::atomic<uint64_t>>(
            mapped_ram_bitmap_size(blocks[i].desc.used_length >> TARGET_PAGE_BITS) / 8);
    }
}

const MappedRamHeader &MappedRamSave::place(size_t block, uint64_t header_pos)
{
    Block &b = blocks_[block];
    b.layout = mapped_ram_layout(header_pos, b.used_length);
    return b.layout;
}

namespace {

// What the zero gaps inside a write point at (page-aligned for O_DIRECT).
alignas(4096) const uint8_t kZeroGap[MappedRamSave::kZeroGapPages * TARGET_PAGE_SIZE] = {};

// Zero pages (null) from i on among the n pages, while offsets stay
// consecutive.
uint32_t zero_stretch(const uint64_t *offsets, const uint8_t *const *where, uint32_t i,
                      uint32_t n)
{
    uint32_t k = i;
    while (k < n && !where[k] &&
           (k == i || offsets[k] == offsets[k - 1] + TARGET_PAGE_SIZE)) {
        k++;
    }
    return k - i;
}

} // namespace

Status MappedRamSave::write_pages(Channel &ch, size_t block, const uint64_t *offsets,
                                  const uint8_t *const *where, uint32_t n)
{
    Block &b = blocks_[block];
    std::vector<struct iovec> iov(2 * size_t(n)); // a page or a gap each, at most
    uint32_t i = 0;
    while (i < n) {
        if (!where[i]) { // zero pages before a run's data: nothing to write
            mark(block, offsets[i++], false);
            continue;
        }
        // One run of consecutive offsets starting with data; one iovec per
        // page unless the source bytes are contiguous too (the mapping path).
        int niov = 0;
        uint64_t start = offsets[i];
        uint32_t end = i; // pages [i, end) are in this write
        while (end < n && offsets[end] == start + uint64_t(end - i) * TARGET_PAGE_SIZE) {
            if (where[end]) {
                mark(block, offsets[end], true);
                iov_append(iov.data(), &niov, where[end], TARGET_PAGE_SIZE);
                end++;
                continue;
            }
            uint32_t z = zero_stretch(offsets, where, end, n);
            uint32_t after = end + z;
            bool more = after < n && where[after] &&
                        offsets[after] == offsets[after - 1] + TARGET_PAGE_SIZE;
            if (z > kZeroGapPages || !more) {
                break; // a long stretch, or trailing zeros: the write ends here
            }
            for (uint32_t k = end; k < after; k++) {
                mark(block, offsets[k], false);
            }
            iov[niov++] = {const_cast<uint8_t *>(kZeroGap), size_t(z) * TARGET_PAGE_SIZE};
            end = after;
        }
        QMIGD_TRY(pwritev_full(ch.fd(), iov.data(), niov, b.layout.pages_offset + start));
        i = end;
    }
    return {};
}

void MappedRamSave::mark(size_t block, uint64_t offset, bool data)
{
    uint64_t page = offset >> TARGET_PAGE_BITS;
    uint64_t bit = uint64_t(1) << (page % 64);
    if (data) {
        blocks_[block].bmap[page / 64].fetch_or(bit, std::memory_order_relaxed);
    } else {
        blocks_[block].bmap[page / 64].fetch_and(~bit, std::memory_order_relaxed);
    }
}

void MappedRamSave::mark_zero(size_t block, uint64_t offset)
{
    mark(block, offset, false);
}

Result<uint64_t> MappedRamSave::write_bitmaps(QEMUFileWriter &out)
{
    uint64_t total = 0;
    std::vector<uint8_t> bytes;
    for (const Block &b : blocks_) {
        bytes.resize(b.bmap.size() * 8);
        for (size_t w = 0; w < b.bmap.size(); w++) {
            put_le64(&bytes[w * 8], b.bmap[w].load(std::memory_order_relaxed));
        }
        QMIGD_TRY(out.write_at(bytes.data(), bytes.size(), b.layout.bitmap_offset));
        total += bytes.size();
    }
    return total;
}

} // namespace qmigd
