// The source's side of mapped-ram (QEMU's file_bmap, mapped_ram_setup_ramblock()
// and file_write_ramblock_iov()): where each RAMBlock's pages go in the
// migration file, and which of them hold data.
//
// Pages are not part of the stream: whichever thread handles a page (the
// migration thread, or a multifd channel thread with its own descriptor of
// the same file) writes it at pages_offset + offset with pwritev, or, for a
// zero page, writes nothing and clears its bit. A page sent again in a
// later round lands at the same place, so the file's size is bounded.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "daemon/source/qemu_file_writer.h"
#include "daemon/ram_blocks.h"
#include "protocol/mapped_ram.h"

namespace qmigd {

class Channel;

class MappedRamSave {
public:
    explicit MappedRamSave(const std::vector<RAMBlock> &blocks);

    // Migration thread, setup: the block's header is written at header_pos;
    // returns the layout (read-only from here on, by every thread).
    const MappedRamHeader &place(size_t block, uint64_t header_pos);

    // Any thread, on its own channel (a descriptor of the file): stores n pages of `block` at their fixed places (page
    // i's bytes at where[i]; a null where[i] is a zero page: its bit is
    // cleared and it needs no bytes in the file), one pwritev per run of
    // consecutive offsets. Up to kZeroGapPages zero pages between two data
    // pages of a run are written as zeros rather than cut the write in two.
    Status write_pages(Channel &ch, size_t block, const uint64_t *offsets,
                       const uint8_t *const *where, uint32_t n);
    // Any thread: the page is zero now; nothing is written.
    void mark_zero(size_t block, uint64_t offset);

    // Migration thread, after the last multifd sync: every block's bitmap
    // at its bitmap_offset (ram_save_file_bmap()). Returns bytes written.
    Result<uint64_t> write_bitmaps(QEMUFileWriter &out);

    // A request to a disk costs about what 256 KiB of its bandwidth does
    // (measured here: ~0.3-0.6 ms per O_DIRECT write of a virtual disk that
    // writes ~1.2 GB/s; NVMe: ~20 us at ~3 GB/s, where 64 KiB of zeros is
    // the break-even and 256 KiB at worst costs a request more per gap).
    static constexpr uint32_t kZeroGapPages = 64;

private:
    // The page's bit: set = its data is in the file.
    void mark(size_t block, uint64_t offset, bool data);

    struct Block {
        uint64_t used_length = 0;
        MappedRamHeader layout;
        // One bit per page, set = data in the file. Atomic: channel
        // threads set and clear bits of pages in the same word.
        std::vector<std::atomic<uint64_t>> bmap;
    };
    std::vector<Block> blocks_;
};

} // namespace qmigd
