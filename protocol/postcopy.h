// The commands of a postcopy migration on the main channel (QEMU's
// savevm.c qemu_savevm_send_postcopy_*() and postcopy-ram.c's discard
// batching). Pure byte layout.
//
// The source's order: POSTCOPY_ADVISE right after the header (and the
// return path's PING); at switchover, RAM_DISCARD for every page dirty
// again, PING(2), then one PACKAGED command whose body is LISTEN, the
// device sections, PING(3) and RUN; PING(4); then the rest of RAM in
// PART sections and an END section, and EOF.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "protocol/wire.h"

namespace qmigd {

// The PINGs QEMU's postcopy_start() sends around the package.
constexpr uint32_t POSTCOPY_PING_DISCARDED = 2; // after the discards
constexpr uint32_t POSTCOPY_PING_PACKAGED = 3;  // inside the package, before RUN
constexpr uint32_t POSTCOPY_PING_RUNNING = 4;   // after the package
// Ranges per RAM_DISCARD command (MAX_DISCARDS_PER_COMMAND).
constexpr size_t POSTCOPY_DISCARDS_PER_COMMAND = 12;
constexpr uint8_t POSTCOPY_RAM_DISCARD_VERSION = 0;

// POSTCOPY_ADVISE with postcopy-ram: the OR of every block's page size
// and the target page size.
void savevm_put_postcopy_advise(ByteWriter &w, uint64_t pagesize_summary);

// Byte ranges (start, length) of a block.
using DiscardRanges = std::vector<std::pair<uint64_t, uint64_t>>;
// The runs of set bits of a page bitmap (`pages` bits), in bytes.
DiscardRanges postcopy_discard_ranges(std::span<const uint64_t> bitmap, uint64_t pages);
// RAM_DISCARD commands for one block, POSTCOPY_DISCARDS_PER_COMMAND
// ranges each (none for no ranges).
void savevm_put_postcopy_ram_discard(ByteWriter &w, std::string_view idstr,
                                     const DiscardRanges &ranges);

// PACKAGED: be32 length, then the package itself.
void savevm_put_packaged(ByteWriter &w, std::span<const uint8_t> package);

// --- recovery (QEMU's postcopy_pause() and postcopy_do_resume()) ---
// After a broken link the source sends, on the new main channel and with
// no header, RECV_BITMAP for each block; the destination answers each on
// the return path with a RECV_BITMAP message and then its received bitmap:
// be64 size in bytes (the page count / 8, rounded up to 8), the bitmap in
// little-endian 64-bit words, be64 RAMBLOCK_RECV_BITMAP_ENDING. Then
// POSTCOPY_RESUME, answered by RESUME_ACK(1), and the stream goes on.
constexpr uint64_t RAMBLOCK_RECV_BITMAP_ENDING = 0x0123456789abcdefULL;
constexpr uint32_t MIGRATION_RESUME_ACK_VALUE = 1;

// RECV_BITMAP: u8 length, block name.
void savevm_put_recv_bitmap(ByteWriter &w, std::string_view idstr);
// The size field of a block's received bitmap, in bytes.
uint64_t recv_bitmap_size(uint64_t pages);
// A received bitmap as the destination sends it (after the message).
void rp_put_recv_bitmap_data(std::vector<uint8_t> &out, std::span<const uint64_t> bitmap,
                             uint64_t pages);

} // namespace qmigd
