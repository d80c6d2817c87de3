#include "daemon/mapped_ram_save.h"

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

Status MappedRamSave::write_pages(int fd, size_t block, const uint64_t *offsets,
                                  const uint8_t *const *where, uint32_t n)
{
    Block &b = blocks_[block];
    struct iovec iov[MULTIFD_PACKET_PAGES];
    uint32_t i = 0;
    while (i < n) {
        // One run of consecutive pages; one iovec per page unless the
        // source bytes are contiguous too (the mapping path).
        uint32_t run = 0;
        int niov = 0;
        while (i + run < n && offsets[i + run] == offsets[i] + uint64_t(run) * TARGET_PAGE_SIZE &&
               niov < int(MULTIFD_PACKET_PAGES)) {
            iov_append(iov, &niov, where[i + run], TARGET_PAGE_SIZE);
            run++;
        }
        QMIGD_TRY(pwritev_full(fd, iov, niov, b.layout.pages_offset + offsets[i]));
        for (uint32_t k = 0; k < run; k++) {
            uint64_t page = (offsets[i + k] >> TARGET_PAGE_BITS);
            b.bmap[page / 64].fetch_or(uint64_t(1) << (page % 64), std::memory_order_relaxed);
        }
        i += run;
    }
    return {};
}

void MappedRamSave::mark_zero(size_t block, uint64_t offset)
{
    uint64_t page = offset >> TARGET_PAGE_BITS;
    blocks_[block].bmap[page / 64].fetch_and(~(uint64_t(1) << (page % 64)),
                                             std::memory_order_relaxed);
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
