// libFuzzer target: a receive channel's compressed packets. The input is
// one byte choosing the method (bit 0: zlib or zstd), then packets, each a
// page count byte (n = byte % 128 + 1), a big-endian 16-bit payload length
// and the payload, inflated by one stream per input as a channel does.
// Each packet's pages are their own exact-size allocation, so a write
// past a page is an ASan report, and a success must fill every page.
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "protocol/multifd_compress.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) {
        return 0;
    }
    auto method = data[0] & 1 ? MultiFDCompression::Zstd : MultiFDCompression::Zlib;
    auto d = multifd_method(method).make_decompressor();
    if (!d.ok()) {
        __builtin_trap();
    }
    size_t pos = 1;
    while (pos + 3 <= size) {
        uint32_t n = data[pos] % MULTIFD_PACKET_PAGES + 1;
        size_t len = size_t(data[pos + 1]) << 8 | data[pos + 2];
        pos += 3;
        len = std::min(len, size - pos);
        std::vector<std::unique_ptr<uint8_t[]>> pages(n);
        std::vector<uint8_t *> where(n);
        for (uint32_t i = 0; i < n; i++) {
            pages[i].reset(new uint8_t[TARGET_PAGE_SIZE]);
            std::memset(pages[i].get(), 0xa5, TARGET_PAGE_SIZE);
            where[i] = pages[i].get();
        }
        // The payload in its own allocation: reads past it are reported too.
        std::unique_ptr<uint8_t[]> payload(new uint8_t[len ? len : 1]);
        std::memcpy(payload.get(), data + pos, len);
        pos += len;
        if (!(*d)->decompress(payload.get(), len, where.data(), n).ok()) {
            break; // a channel fails its migration here
        }
    }
    return 0;
}
