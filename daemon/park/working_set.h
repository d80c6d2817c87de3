// A parked VM's working set: the pages its destinations asked for first
// when it was resumed by postcopy, in the order they asked, kept in
// DIR/working-set.bin so that the next postcopy resume sends them first
// (daemon/source/postcopy_working_set.h).
//
// The file is input like every other file of the directory: a bad one
// (truncated, a block the VM does not have, a range past its block, more
// pages than the format allows, bytes after the end) is refused whole,
// and the resume then goes on without it. Layout, big-endian:
//
//   "QMIGD-WS"  u32 version (1)
//   u32 blocks (1..256), each: u8 idstr length (1..255), idstr, u64 size
//   u32 ranges, each: u16 block (an index in the list above),
//                     u64 offset (page aligned), u32 pages (>= 1)
//
// Blocks are named, not numbered, and carry their size: a record is
// checked against the parked VM's blocks by name and size.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "daemon/park/parked_vm.h"
#include "protocol/error.h"

namespace qmigd {

struct WorkingSetRange {
    size_t block = 0;    // index in ParkedVm::blocks
    uint64_t offset = 0; // bytes, page aligned
    uint64_t pages = 0;  // target pages from offset, inside the block
};

// What a working set may hold at most: 16 GiB of pages, in as many ranges
// as that; larger counts are a broken or hostile file.
constexpr uint64_t kWorkingSetMaxPages = uint64_t(1) << 22;
constexpr size_t kWorkingSetMaxRanges = size_t(1) << 20;

// `qmigd source --working-set...`: whether a postcopy resume of a parked
// VM records the pages asked for and sends a recorded working set first,
// and how long and how much it records (from the destination's RUN on).
struct WorkingSetOptions {
    bool on = true;
    double window_s = 2.0;
    uint64_t max_pages = 65536; // 256 MiB of target pages
    // After the recorded pages, the aligned span of this many pages around
    // each (in the record's order): a guest's kernel hands out pages from
    // the same regions each time, but not the same pages. 0 or 1: none.
    uint64_t around_pages = 512;
};

std::string working_set_path(const std::string &dir);
uint64_t working_set_pages(const std::vector<WorkingSetRange> &ranges);
// The file's bytes for `ranges` of `blocks` (ranges within bounds, at most
// the limits above: the writer keeps to what the reader takes).
std::vector<uint8_t> working_set_encode(const std::vector<ParkedBlock> &blocks,
                                        const std::vector<WorkingSetRange> &ranges);
// The ranges of a file's bytes, checked against the VM's blocks.
Result<std::vector<WorkingSetRange>> working_set_decode(std::span<const uint8_t> bytes,
                                                        const std::vector<ParkedBlock> &blocks);
// DIR/working-set.bin of a parked VM: empty when there is none; an error
// when there is one that cannot be read or does not check.
Result<std::vector<WorkingSetRange>> working_set_read(const ParkedVm &vm);
// Writes it as the park writes vm.json (a temporary name of this writer's
// own, fsync, rename, directory fsync): two resumes of one directory that
// write at once each publish a whole file, the last one stays.
Status working_set_write(const ParkedVm &vm, const std::vector<WorkingSetRange> &ranges);

} // namespace qmigd
