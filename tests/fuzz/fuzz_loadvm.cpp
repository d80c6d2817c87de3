// libFuzzer target: arbitrary bytes as a main channel (plain, postcopy,
// multifd, mapped-ram, x-ignore-shared and park configurations; XBZRLE
// records and dirty-bitmap sections included) and as a multifd packet
// header. The decoders must reject
// or accept without touching memory outside what they validated.
#include <cstdint>
#include <cstring>
#include <vector>

#include "protocol/loadvm.h"
#include "protocol/multifd_packet.h"
#include "park_ram.h"

using namespace qmigd;

namespace {

constexpr uint64_t kBlockSize = 8 * TARGET_PAGE_SIZE;

struct BoundedRam : LoadvmHandler {
    std::vector<uint8_t> ram = std::vector<uint8_t>(kBlockSize);
    Status put_page(size_t block, uint64_t offset, const uint8_t *data) override
    {
        if (block != 0 || offset + TARGET_PAGE_SIZE > ram.size()) {
            __builtin_trap(); // the loader let an invalid page through
        }
        std::memcpy(ram.data() + offset, data, TARGET_PAGE_SIZE);
        return {};
    }
    Status zero_page(size_t block, uint64_t offset) override
    {
        if (block != 0 || offset + TARGET_PAGE_SIZE > ram.size()) {
            __builtin_trap();
        }
        std::memset(ram.data() + offset, 0, TARGET_PAGE_SIZE);
        return {};
    }
    Status read_page(size_t block, uint64_t offset, uint8_t *out) override
    {
        if (block != 0 || offset + TARGET_PAGE_SIZE > ram.size()) {
            __builtin_trap(); // an XBZRLE record for a page outside the block
        }
        std::memcpy(out, ram.data() + offset, TARGET_PAGE_SIZE);
        return {};
    }
    Status multifd_flush() override { return {}; }
    Status open_return_path() override { return {}; }
    Status ping(uint32_t) override { return {}; }
    Status discard_range(size_t block, uint64_t start, uint64_t length) override
    {
        if (block != 0 || start % TARGET_PAGE_SIZE || length % TARGET_PAGE_SIZE ||
            start > kBlockSize || length > kBlockSize - start) {
            __builtin_trap(); // the loader let a discard outside the block through
        }
        return {};
    }
    // mapped-ram: the input is the whole file; a header that passes the
    // checks names regions inside it.
    uint64_t file_size = 0;
    Status mapped_ram_block(size_t block, const MappedRamHeader &h) override
    {
        if (block != 0) {
            __builtin_trap();
        }
        QMIGD_TRY(mapped_ram_header_check(h, "mem", kBlockSize, file_size));
        if (h.pages_offset + kBlockSize > file_size ||
            h.bitmap_offset + mapped_ram_bitmap_size(kBlockSize / TARGET_PAGE_SIZE) > file_size) {
            __builtin_trap(); // the check let a region outside the file through
        }
        return {};
    }
};

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (int mode : {0, 1, 2, 3, 4}) { // plain, multifd, mapped-ram, postcopy, ignore-shared
        LoadvmConfig cfg;
        cfg.blocks = {{"mem", kBlockSize}};
        cfg.multifd = mode == 1;
        cfg.mapped_ram = mode == 2;
        cfg.postcopy_ram = mode == 3;
        cfg.ignore_shared = mode == 4;
        MemoryInputStream in(data, size);
        QEMUFileReader f(in, 256);
        BoundedRam ram;
        ram.file_size = size;
        (void)qemu_loadvm_state(f, cfg, ram);
    }
    {
        MemoryInputStream in(data, size);
        park_load(in, 256, true);
    }
    if (size >= MULTIFD_PACKET_HEADER_SIZE) {
        RamBlockDesc blocks[] = {{"mem", kBlockSize}};
        auto p = multifd_packet_decode(data, blocks);
        if (p.ok()) {
            for (uint32_t i = 0; i < p->normal_pages + p->zero_pages; i++) {
                if (p->offsets[i] + TARGET_PAGE_SIZE > kBlockSize || p->offsets[i] % TARGET_PAGE_SIZE) {
                    __builtin_trap();
                }
            }
        }
    }
    return 0;
}
