// FakeLoader: the unit tests' one fake loader handler (protocol/loadvm.h), RAM in a byte vector.
#pragma once

#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "protocol/loadvm.h"
#include "protocol/postcopy.h"
#include "protocol/return_path.h"
#include "protocol/savevm.h"

namespace qmigd {

// With `ram_bytes`, pages go into `ram` (bounds checked; block 0 only
// until blocks are announced, then any announced one); without, only the
// announced blocks' bounds are checked. It records what the stream asked
// for; a return path (OPEN_RETURN_PATH, PING) only with `has_return_path`.
struct FakeLoader : LoadvmHandler {
    explicit FakeLoader(size_t ram_bytes = 0, uint8_t fill = 0) : ram(ram_bytes, fill) {}

    std::vector<uint8_t> ram;
    std::vector<RamBlockDesc> announced;
    int announcements = 0;
    int flushes = 0;
    Status flush_result;          // what MULTIFD_FLUSH returns
    bool has_return_path = false; // else LoadvmHandler's refusals
    std::vector<uint32_t> pongs;
    DiscardRanges discards;
    bool listening = false;

    void check_page(size_t block, uint64_t offset) const
    {
        REQUIRE(block < std::max<size_t>(announced.size(), ram.empty() ? 0 : 1));
        if (ram.empty()) {
            REQUIRE(offset < announced[block].used_length);
        } else {
            REQUIRE(offset + TARGET_PAGE_SIZE <= ram.size());
        }
    }
    Status put_page(size_t block, uint64_t offset, const uint8_t *data) override
    {
        check_page(block, offset);
        if (!ram.empty()) {
            std::memcpy(ram.data() + offset, data, TARGET_PAGE_SIZE);
        }
        return {};
    }
    Status read_page(size_t block, uint64_t offset, uint8_t *out) override
    {
        if (ram.empty()) {
            return LoadvmHandler::read_page(block, offset, out);
        }
        check_page(block, offset);
        std::memcpy(out, ram.data() + offset, TARGET_PAGE_SIZE);
        return {};
    }
    Status zero_page(size_t block, uint64_t offset) override
    {
        check_page(block, offset);
        if (!ram.empty()) {
            std::memset(ram.data() + offset, 0, TARGET_PAGE_SIZE);
        }
        return {};
    }
    Status multifd_flush() override
    {
        flushes++;
        return flush_result;
    }
    Status announce_blocks(const std::vector<RamBlockDesc> &d) override
    {
        announced = d;
        announcements++;
        return {};
    }
    Status open_return_path() override
    {
        return has_return_path ? Status() : LoadvmHandler::open_return_path();
    }
    Status ping(uint32_t value) override
    {
        if (!has_return_path) {
            return LoadvmHandler::ping(value);
        }
        pongs.push_back(value);
        return {};
    }
    void postcopy_listening() override { listening = true; }
    Status discard_range(size_t block, uint64_t start, uint64_t length) override
    {
        (void)block;
        discards.emplace_back(start, length);
        return {};
    }
};

// What a precopy stream ends with after RAM's last part (RAM is section
// 1): the switchover, RAM's END section, the timer, a globalstate of
// `runstate`, the EOF and its vmdesc; a file (mapped-ram) has no
// SWITCHOVER_START.
inline void put_stream_end(ByteWriter &w, const char *runstate = "running",
                           bool switchover_start = true)
{
    if (switchover_start) {
        savevm_put_command(w, MIG_CMD_SWITCHOVER_START);
    }
    savevm_put_section_continue(w, QEMU_VM_SECTION_END, 1);
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
    savevm_put_timer(w, 0);
    savevm_put_globalstate(w, 3, runstate);
    savevm_put_eof_and_vmdesc(w);
}

// The postcopy stream the unit tests load, for one block "mem" of
// kPostcopyBlock: page 1 = 0x11 in precopy, discarded, then 0x22 in
// postcopy with page 2 zero; the package (postcopy_package(): the device
// state, LISTEN, RUN) in between. postcopy_head() ends after the package
// (a main channel broken there leaves the loader in postcopy),
// postcopy_tail() is the rest.
constexpr uint64_t kPostcopyBlock = 16 * TARGET_PAGE_SIZE;

inline void put_postcopy_page(ByteWriter &w, RamRecordEncoder &rec, uint64_t page, uint8_t fill)
{
    RamBlockDesc mem{"mem", kPostcopyBlock};
    rec.put_page_header(w, mem, page * TARGET_PAGE_SIZE);
    std::vector<uint8_t> bytes(TARGET_PAGE_SIZE, fill);
    w.bytes(bytes.data(), bytes.size());
}

inline std::vector<uint8_t> postcopy_package()
{
    std::vector<uint8_t> pkg;
    ByteWriter p(pkg);
    savevm_put_command(p, MIG_CMD_POSTCOPY_LISTEN);
    savevm_put_timer(p, 0);
    savevm_put_globalstate(p, 3, "running");
    savevm_put_ping(p, POSTCOPY_PING_PACKAGED);
    savevm_put_command(p, MIG_CMD_POSTCOPY_RUN);
    return pkg;
}

inline std::vector<uint8_t> postcopy_head(const std::vector<uint8_t> &pkg = postcopy_package())
{
    RamBlockDesc mem{"mem", kPostcopyBlock};
    std::vector<uint8_t> out;
    ByteWriter w(out);
    RamRecordEncoder rec;
    savevm_put_header(w);
    savevm_put_configuration(w, "none");
    savevm_put_command(w, MIG_CMD_OPEN_RETURN_PATH);
    savevm_put_ping(w, RP_PING_OPEN);
    savevm_put_postcopy_advise(w, TARGET_PAGE_SIZE);
    savevm_put_section_header(w, QEMU_VM_SECTION_START, 1, "ram", 0, 4);
    ram_put_mem_size(w, std::span(&mem, 1));
    put_postcopy_page(w, rec, 1, 0x11);
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
    savevm_put_command(w, MIG_CMD_SWITCHOVER_START);
    savevm_put_postcopy_ram_discard(w, "mem", {{TARGET_PAGE_SIZE, 2 * TARGET_PAGE_SIZE}});
    savevm_put_ping(w, POSTCOPY_PING_DISCARDED);
    savevm_put_packaged(w, pkg);
    return out;
}

// `resumed`: as a source resumed by migrate-recover sends it on its new
// main channel (QEMU's postcopy_do_resume()), after the received bitmap
// it asks for and RESUME.
inline std::vector<uint8_t> postcopy_tail(bool resumed = false)
{
    RamBlockDesc mem{"mem", kPostcopyBlock};
    std::vector<uint8_t> out;
    ByteWriter w(out);
    RamRecordEncoder rec;
    if (resumed) {
        savevm_put_recv_bitmap(w, "mem");
        savevm_put_command(w, MIG_CMD_POSTCOPY_RESUME);
    }
    savevm_put_ping(w, POSTCOPY_PING_RUNNING);
    savevm_put_section_continue(w, QEMU_VM_SECTION_PART, 1);
    put_postcopy_page(w, rec, 1, 0x22);
    rec.put_zero_page(w, mem, 2 * TARGET_PAGE_SIZE);
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
    savevm_put_section_continue(w, QEMU_VM_SECTION_END, 1);
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
    w.u8(QEMU_VM_EOF); // no VM description in postcopy
    return out;
}

} // namespace qmigd
