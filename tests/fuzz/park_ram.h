// The loader's owner of RAM in park mode, for the fuzz targets: blocks
// come from the stream, and every page, discard and block list the loader
// hands over must lie inside what was announced (a trap otherwise).
#pragma once

#include <cstring>
#include <vector>

#include "protocol/device_state.h"
#include "protocol/iterable_state.h"
#include "protocol/loadvm.h"

namespace qmigd {

struct ParkRam : LoadvmHandler {
    std::vector<RamBlockDesc> blocks;
    Status put_page(size_t block, uint64_t offset, const uint8_t *) override
    {
        return check(block, offset);
    }
    Status zero_page(size_t block, uint64_t offset) override { return check(block, offset); }
    Status read_page(size_t block, uint64_t offset, uint8_t *out) override
    {
        std::memset(out, 0, TARGET_PAGE_SIZE);
        return check(block, offset);
    }
    Status multifd_flush() override { return {}; }
    Status open_return_path() override { return {}; }
    Status ping(uint32_t) override { return {}; }
    Status discard_range(size_t block, uint64_t start, uint64_t length) override
    {
        if (block >= blocks.size() || start % TARGET_PAGE_SIZE || length % TARGET_PAGE_SIZE ||
            start > blocks[block].used_length || length > blocks[block].used_length - start) {
            __builtin_trap();
        }
        return {};
    }
    Status announce_blocks(const std::vector<RamBlockDesc> &b) override
    {
        if (!blocks.empty() || b.empty()) {
            __builtin_trap(); // announced twice, or nothing
        }
        blocks = b;
        return {};
    }
    Status check(size_t block, uint64_t offset)
    {
        if (block >= blocks.size() || offset % TARGET_PAGE_SIZE ||
            offset + TARGET_PAGE_SIZE > blocks[block].used_length) {
            __builtin_trap();
        }
        return {};
    }
};

// A parking load of the whole stream (multifd on, postcopy-ram as asked),
// reading through a buffer of `buffer` bytes. What it keeps must read back.
inline void park_load(InputStream &in, size_t buffer, bool postcopy)
{
    LoadvmConfig cfg;
    cfg.park = true;
    cfg.multifd = true;
    cfg.postcopy_ram = postcopy;
    QEMUFileReader f(in, buffer);
    ParkRam ram;
    auto r = qemu_loadvm_state(f, cfg, ram);
    if (r.ok() && !device_state_check(r->device_state).ok()) {
        __builtin_trap(); // parked a device state that is not whole
    }
    if (r.ok() && !iterable_state_split(r->iterable_state).ok()) {
        __builtin_trap(); // kept iterable sections it could not read back
    }
}

} // namespace qmigd
