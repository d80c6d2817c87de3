// The RAM save side of the source (QEMU's ram.c): the migration bitmaps,
// the dirty sync, the walk over dirty pages and what becomes of each page
// -- a ZERO or PAGE record on the main channel, a place in a multifd
// packet, or, with mapped-ram, a place in the file.
//
// The migration thread (migration_thread.h) decides when to walk, sync,
// flush and stop; this class decides how. Migration thread only.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "daemon/source/mapped_ram_save.h"
#include "daemon/source/multifd_send.h"
#include "daemon/source/qemu_file_writer.h"
#include "daemon/ram_blocks.h"
#include "daemon/source/xbzrle_save.h"
#include "protocol/savevm.h"
#include "protocol/savevm.h"
#include "ramstate/zero_page.h"

namespace qmigd {

// A channel that carries ZERO/PAGE records: the main channel, or
// postcopy's preempt channel; each remembers its own last block (CONTINUE).
struct PageChannel {
    QEMUFileWriter &out;
    RamRecordEncoder records;
};

class RamSave {
public:
    // `multifd` and `file` may be null (multifd off; no mapped-ram).
    RamSave(std::vector<RAMBlock> &blocks, ZeroPageDetection zpd, QEMUFileWriter &out,
            MultifdSend *multifd, MappedRamSave *file);

    // The MEM_SIZE record of the setup section, with each block's mapped-ram
    // header when there is one (and, with postcopy-ram, its page size
    // where that is not 4096).
    Status put_ram_layout(RamListOptions opts);
    // xbzrle (main channel only; the monitor refuses it with multifd and
    // mapped-ram): deltas from the second round on. Owned by the caller.
    void set_xbzrle(XbzrleSave *x) { xbzrle_ = x; }
    // x-ignore-shared: every qmigd block is a shared memory file, so none
    // is sent (QEMU's migrate_ram_is_ignored()): no page is ever dirty.
    void ignore_all_blocks() { ignore_all_ = true; }
    // QEMU's ram_pagesize_summary(): every block's page size, ORed.
    uint64_t pagesize_summary() const;
    // postcopy_chunk_hostpages(): a huge page partly still to send is to
    // send whole (postcopy places whole pages at the destination).
    void postcopy_chunk_host_pages();
    // Dirty sync 1: every page is to be sent.
    void mark_all_dirty();
    // Moves every bit the guest set since the last sync into the migration
    // bitmaps (migration_bitmap_sync()); returns the pages added.
    uint64_t dirty_sync();
    // Sends dirty pages word by word from the cursor. Stops at the end of a
    // round (*round_done, after round_flush()) or, unless until_done, when
    // should_yield() says the slice or the rate window is used up.
    Status send_dirty(bool until_done, bool *round_done, const std::function<bool()> &should_yield);
    // Postcopy: the pages of [offset, offset + len) still to send, now
    // (a destination's request), on `urgent` if given, else the main
    // channel. Bounds are the caller's (PageRequests).
    Status send_range(size_t block, uint64_t offset, uint64_t len, PageChannel *urgent = nullptr);
    // End of a pass (and of setup): with multifd, every page queued so far
    // lands before the main channel goes on (SYNC on every channel, then
    // MULTIFD_FLUSH; with mapped-ram only the wait). Nothing without multifd.
    Status round_flush();
    // mapped-ram, after the last round: the bitmaps of pages in the file.
    Status write_file_bitmaps();

    uint64_t dirty_pages() const { return dirty_pages_; }
    // Postcopy recovery (ram_dirty_bitmap_reload()): every page of block i
    // the destination does not have is to send again, from the start.
    void reload_bitmap(size_t block, const std::vector<uint64_t> &received);
    // After the reloads: recount, restart the walk, and name the block in
    // the next record (a new channel has no previous block).
    void resume_prepare();
    // A block's migration bitmap: pages still to send.
    std::span<const uint64_t> bitmap(size_t block) const { return bitmaps_[block]; }
    // Pages and bytes the main thread sent itself (multifd counts its own).
    uint64_t normal_pages() const { return normal_; }
    uint64_t zero_pages() const { return zero_; }
    uint64_t file_bytes() const { return file_bytes_; }
    // Where record bytes are counted: precopy, then downtime after switchover.
    void count_bytes_in(std::atomic<uint64_t> *counter) { counter_ = counter; }

private:
    Status send_word(size_t block, size_t word, uint64_t bits);
    Status send_page(size_t block, uint64_t offset, const uint8_t *data);
    Status send_range_on(size_t block, uint64_t offset, uint64_t len);
    Status save_word_to_file(size_t block, const uint64_t *offsets, const uint8_t **where,
                             uint32_t n);

    std::vector<RAMBlock> &blocks_;
    const ZeroPageDetection zpd_;
    QEMUFileWriter &out_;
    MultifdSend *const multifd_;
    MappedRamSave *const file_;
    std::atomic<uint64_t> *counter_ = nullptr;
    bool ignore_all_ = false;
    XbzrleSave *xbzrle_ = nullptr;
    std::vector<uint64_t> block_base_; // a block's first page address across all blocks
    PageChannel main_;
    PageChannel *ch_ = &main_; // where send_word() writes records
    std::vector<RamBlockDesc> descs_;
    // Migration bitmaps: pages still to send, one bit per page.
    std::vector<std::vector<uint64_t>> bitmaps_;
    uint64_t dirty_pages_ = 0;
    // Scan cursor: block and word (the round wraps when it passes the end).
    size_t cur_block_ = 0;
    size_t cur_word_ = 0;
    uint64_t normal_ = 0, zero_ = 0;
    uint64_t file_bytes_ = 0; // mapped-ram pages and bitmaps written here
    // Main-thread page reads (File path): one bitmap word's worth.
    std::unique_ptr<uint8_t[]> word_buf_{new uint8_t[64 * TARGET_PAGE_SIZE]};
};

} // namespace qmigd
