// libFuzzer target: arbitrary --ram option texts and sizes. A spec that
// parses has a name of 1..255 bytes and a path; a size never wraps.
#include <cstdint>
#include <string>

#include "daemon/ram_blocks.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    std::string text(reinterpret_cast<const char *>(data), size);
    auto spec = ram_block_spec_parse(text);
    if (spec.ok() && (spec->name.empty() || spec->name.size() > 255 || spec->path.empty())) {
        __builtin_trap();
    }
    uint64_t v = 0;
    if (parse_size(text, &v)) {
        // Re-derive the value without overflow to check no wrap happened.
        unsigned __int128 n = 0;
        size_t i = 0;
        for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; i++) {
            n = n * 10 + unsigned(text[i] - '0');
            if (n >> 64) {
                __builtin_trap(); // parse_size accepted an overflowing number
            }
        }
        // The oracle reads decimal digits and a unit; parse_size also takes
        // QEMU's hex, fractions and leading blanks, which it leaves be.
        if (i == 0 || (i < text.size() && (text[i] == '.' || text[i] == 'x' || text[i] == 'X'))) {
            return 0;
        }
        static const std::string units = "bkmgtpe";
        unsigned shift = i < text.size() ? unsigned(units.find(char(text[i] | 0x20))) * 10 : 0;
        if (((n << shift) >> 64) != 0 || uint64_t(n << shift) != v) {
            __builtin_trap();
        }
    }
    return 0;
}
