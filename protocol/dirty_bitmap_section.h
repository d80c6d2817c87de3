// The body of QEMU's "dirty-bitmap" iterable section (capability
// dirty-bitmaps, migration/block-dirty-bitmap.c): block dirty bitmaps of a
// VM's disks, records until an EOS flag.
//
//   record = flags [node name] [bitmap name] payload
//   flags  = u8, widened to 16 then 32 bits while the 0x80 bit is set
//   names  = u8 length + bytes, when DEVICE_NAME / BITMAP_NAME is set
//   START  : be32 granularity, u8 start flags (enabled, persistent)
//   BITS   : be64 first sector, be32 sector count [be64 size, bytes] (no
//            bytes with ZEROES)
//   COMPLETE, EOS: nothing
//
// qmigd has no disks: it only needs the body's end (a section carries no
// length on the wire), and, parking a VM, the bytes as they came.
#pragma once

#include <cstdint>
#include <vector>

#include "protocol/error.h"
#include "protocol/qemu_file.h"

namespace qmigd {

constexpr const char *DIRTY_BITMAP_SECTION = "dirty-bitmap";
constexpr uint32_t DIRTY_BITMAP_SECTION_VERSION = 1;

// Reads one section body to its EOS with QEMU's bounds (a bits chunk of at
// most 10 KiB, no reserved start flags); appends what it read to `keep`
// when given, failing as soon as it would hold more than max_keep bytes.
// Errors in QEMU's words.
Status dirty_bitmap_section_read(QEMUFileReader &f, std::vector<uint8_t> *keep,
                                 size_t max_keep = 0);

} // namespace qmigd
