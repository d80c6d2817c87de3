// QEMU 10's dirty-rate arithmetic (migration/dirtyrate.c): the page hash
// page-sampling compares, how many pages it samples, and the rates.
// Pure functions: the measuring itself is daemon/source/dirty_rate.h.
#pragma once

#include <cstdint>

namespace qmigd {

// calc-dirty-rate's limits and defaults, as QEMU 10.0 has them.
inline constexpr int64_t kDirtyRateMinCalcMs = 50;
inline constexpr int64_t kDirtyRateMaxCalcMs = 60000;
inline constexpr int64_t kDirtyRateMinSamplePages = 128;   // per GiB
inline constexpr int64_t kDirtyRateMaxSamplePages = 16384; // per GiB
inline constexpr int64_t kDirtyRateDefaultSamplePages = 512;
// Blocks smaller than this are not sampled (MIN_RAMBLOCK_SIZE, 128 KiB).
inline constexpr uint64_t kDirtyRateMinBlockBytes = 128 << 10;

// compute_page_hash(): XXH64 of one 4 KiB page with seed 1, cut to 32 bits.
uint32_t dirty_rate_page_hash(const uint8_t *page);

// Pages page-sampling hashes in a block of `bytes`: sample_pages per GiB,
// rounded down (get_ramblock_dirty_info).
inline uint64_t dirty_rate_samples(uint64_t bytes, uint64_t sample_pages_per_gib)
{
    return (bytes * sample_pages_per_gib) >> 30;
}

// dirty-bitmap: MB/s from pages dirtied in `ms` (do_calculate_dirtyrate:
// times 1000 before the cut to MiB).
inline int64_t dirty_rate_from_pages(uint64_t pages, int64_t ms)
{
    return ms > 0 ? int64_t(((pages * 1000) >> 8) / uint64_t(ms)) : 0;
}

// page-sampling: MB/s from `dirty` of `samples` sampled pages over blocks
// of `total_mib` in `ms` (update_dirtyrate).
inline int64_t dirty_rate_from_samples(uint64_t dirty, uint64_t samples, uint64_t total_mib,
                                       int64_t ms)
{
    return samples && ms > 0 ? int64_t(dirty * total_mib * 1000 / (samples * uint64_t(ms))) : 0;
}

} // namespace qmigd
