// The destination's side of mapped-ram (QEMU's parse_ramblock_mapped_ram()
// and read_ramblock_mapped_ram()): a block's pages are read from their
// fixed places in the migration file, as its bitmap lists them, by one
// thread per multifd channel (one without multifd); every page whose bit
// is clear must read as zero afterwards.
#pragma once

#include <cstdint>
#include <vector>

#include "daemon/io/unique_fd.h"
#include "daemon/ram_blocks.h"
#include "protocol/mapped_ram.h"

namespace qmigd {

// The migration file as the loader reads it. Set up by IncomingMigration
// before the load thread starts; read-only after.
struct MappedRamFileIn {
    int fd = -1; // the main channel's, borrowed (buffered; pread only here)
    std::vector<UniqueFd> direct_fds; // direct-io: one O_DIRECT descriptor per thread
    uint64_t file_size = 0;
    unsigned threads = 1;
};

struct MappedRamCounts {
    uint64_t normal = 0; // pages read from the file
    uint64_t zero = 0;   // pages whose bit was clear
};

// Loads one block after checking its header against the file. Reads go in
// pieces of at most 1 MiB (MAPPED_RAM_LOAD_BUF_SIZE); no write leaves the
// image (every offset comes from a bit below the block's page count).
Status mapped_ram_load_block(const MappedRamFileIn &in, RAMBlock &block,
                             const MappedRamHeader &h, MappedRamCounts *counts);

} // namespace qmigd
