// The mapped-ram layout of a RAMBlock in a migration file (QEMU 9+,
// migration/ram.c: MappedRamHeader, mapped_ram_setup_ramblock()).
//
// With the mapped-ram capability each RAMBlock entry of the MEM_SIZE record
// is followed by this header; the block's pages then live at fixed file
// offsets (page n at pages_offset + n * 4096) and a bitmap at
// bitmap_offset says which of them were written (bit set) or are zero
// (bit clear: never written). The main stream goes on after the block's
// pages region, at pages_offset + used_length.
//
//   be32 version (1) | be64 page_size | be64 bitmap_offset | be64 pages_offset
//
// The bitmap is an array of host `unsigned long`s (little-endian, 64-bit on
// x86_64): bit n of the file's byte n / 8 is page n.
#pragma once

#include <cstdint>
#include <string_view>

#include "protocol/error.h"
#include "protocol/wire.h"

namespace qmigd {

constexpr uint32_t MAPPED_RAM_HDR_VERSION = 1;
constexpr size_t MAPPED_RAM_HEADER_SIZE = 28;
// Where a source puts each block's pages: the next 1 MiB boundary after its
// bitmap, so O_DIRECT can read and write them. A destination requires only
// page alignment, as QEMU does (the constant may change).
constexpr uint64_t MAPPED_RAM_FILE_OFFSET_ALIGNMENT = 0x100000;

struct MappedRamHeader {
    uint32_t version = MAPPED_RAM_HDR_VERSION;
    uint64_t page_size = 0;
    uint64_t bitmap_offset = 0;
    uint64_t pages_offset = 0;
};

// BITS_TO_LONGS(pages) * sizeof(unsigned long): whole 64-bit words.
uint64_t mapped_ram_bitmap_size(uint64_t pages);

// The source's layout for a block of used_length bytes whose header is
// written at file offset header_pos.
MappedRamHeader mapped_ram_layout(uint64_t header_pos, uint64_t used_length);

void mapped_ram_header_put(ByteWriter &w, const MappedRamHeader &h);
MappedRamHeader mapped_ram_header_get(const uint8_t (&b)[MAPPED_RAM_HEADER_SIZE]);

// The destination's checks of a block's header against the file it came
// in (file_size bytes) and the block's used_length: version, page size,
// alignment, and that the bitmap and the pages region lie inside the file.
// QEMU's texts where it has them.
Status mapped_ram_header_check(const MappedRamHeader &h, std::string_view idstr,
                               uint64_t used_length, uint64_t file_size);

} // namespace qmigd
