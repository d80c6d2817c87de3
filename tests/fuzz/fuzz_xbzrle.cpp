// libFuzzer target: XBZRLE deltas (protocol/xbzrle.h). The input is a
// delta applied to a page between guard bytes, which must stay untouched
// whatever the decoder makes of it; and, split in two pages, an old and a
// new one whose encoding must decode back to the new one exactly.
#include <cstdint>
#include <cstring>
#include <vector>

#include "protocol/qemu_format.h"
#include "protocol/xbzrle.h"

using namespace qmigd;

namespace {

constexpr size_t kGuard = 64;

void decode_guarded(const uint8_t *data, size_t size)
{
    std::vector<uint8_t> buf(kGuard + TARGET_PAGE_SIZE + kGuard, 0x5a);
    int n = xbzrle_decode(data, size, buf.data() + kGuard, TARGET_PAGE_SIZE);
    if (n > int(TARGET_PAGE_SIZE)) {
        __builtin_trap();
    }
    for (size_t i = 0; i < kGuard; i++) {
        if (buf[i] != 0x5a || buf[kGuard + TARGET_PAGE_SIZE + i] != 0x5a) {
            __builtin_trap(); // written outside the page
        }
    }
}

// The old page is the input's first half spread over a page, the new one
// the old with the second half's bytes laid over it at spots the bytes
// themselves choose: small, scattered changes, as a guest makes them.
void round_trip(const uint8_t *data, size_t size)
{
    std::vector<uint8_t> old_page(TARGET_PAGE_SIZE), new_page;
    size_t half = size / 2;
    for (size_t i = 0; i < TARGET_PAGE_SIZE && half; i++) {
        old_page[i] = data[i % half];
    }
    new_page = old_page;
    for (size_t i = half; i + 2 < size; i += 3) {
        size_t at = (size_t(data[i]) << 4 | data[i + 1] >> 4) % TARGET_PAGE_SIZE;
        new_page[at] = data[i + 2];
    }
    std::vector<uint8_t> enc(TARGET_PAGE_SIZE);
    int n = xbzrle_encode(old_page.data(), new_page.data(), TARGET_PAGE_SIZE, enc.data(),
                          enc.size());
    if (n < 0) {
        return; // too many changes: a page sent whole
    }
    if ((n == 0) != (old_page == new_page)) {
        __builtin_trap();
    }
    if (xbzrle_decode(enc.data(), size_t(n), old_page.data(), TARGET_PAGE_SIZE) < 0 ||
        old_page != new_page) {
        __builtin_trap(); // our own encoding did not decode back
    }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    decode_guarded(data, size);
    round_trip(data, size);
    return 0;
}
