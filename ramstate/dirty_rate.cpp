// QEMU 10's page hash for page-sampling, written from xxHash's XXH64.
#include "ramstate/dirty_rate.h"

#include <bit>
#include <cstring>

#include "protocol/qemu_format.h"

namespace qmigd {

namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kSeed = 1; // QEMU_XXHASH_SEED

uint64_t xxh_round(uint64_t acc, uint64_t input)
{
    return std::rotl(acc + input * kPrime2, 31) * kPrime1;
}

uint64_t xxh_merge(uint64_t acc, uint64_t v)
{
    return (acc ^ xxh_round(0, v)) * kPrime1 + kPrime4;
}

} // namespace

uint32_t dirty_rate_page_hash(const uint8_t *page)
{
    uint64_t v[4] = {kSeed + kPrime1 + kPrime2, kSeed + kPrime2, kSeed, kSeed - kPrime1};
    for (size_t off = 0; off < TARGET_PAGE_SIZE; off += 32) {
        for (int k = 0; k < 4; k++) {
            uint64_t w;
            std::memcpy(&w, page + off + 8 * size_t(k), 8); // little-endian, as QEMU reads
            v[k] = xxh_round(v[k], w);
        }
    }
    uint64_t h = std::rotl(v[0], 1) + std::rotl(v[1], 7) + std::rotl(v[2], 12) +
                 std::rotl(v[3], 18);
    for (uint64_t x : v) {
        h = xxh_merge(h, x);
    }
    h += TARGET_PAGE_SIZE;
    h ^= h >> 33;
    h *= kPrime2;
    h ^= h >> 29;
    h *= kPrime3;
    h ^= h >> 32;
    return uint32_t(h);
}

} // namespace qmigd
