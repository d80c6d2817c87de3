// COMMAND records of the main channel (QEMU's loadvm_process_command()):
// the return path's, SWITCHOVER_START, and postcopy's -- ADVISE, the
// RAM_DISCARDs, and the PACKAGED device state with LISTEN and RUN in it.
//
// A qmigd destination runs no guest, so postcopy changes little for it:
// after RUN the rest of RAM arrives in PART sections as in precopy, and
// the stream ends with EOF. Discarded pages are sent again, so the stale
// copy is simply overwritten. What postcopy does change is where the
// device state is: in the package, with its length, before RAM ends.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "protocol/device_state.h"
#include "protocol/loader.h"
#include "protocol/wire.h"

namespace qmigd {

namespace {

constexpr MessageArgs kCommands[MIG_CMD_MAX] = {
    {-1, "INVALID"},          {0, "OPEN_RETURN_PATH"}, {4, "PING"},
    {-1, "POSTCOPY_ADVISE"},  {0, "POSTCOPY_LISTEN"},  {0, "POSTCOPY_RUN"},
    {-1, "POSTCOPY_RAM_DISCARD"}, {4, "PACKAGED"},     {0, "ENABLE_COLO"},
    {0, "POSTCOPY_RESUME"},   {-1, "RECV_BITMAP"},     {0, "SWITCHOVER_START"},
};

// What a postcopy package holds around its device sections.
constexpr uint8_t kListen[] = {QEMU_VM_COMMAND, 0, MIG_CMD_POSTCOPY_LISTEN, 0, 0};
constexpr uint8_t kRun[] = {QEMU_VM_COMMAND, 0, MIG_CMD_POSTCOPY_RUN, 0, 0};
constexpr size_t kPingSize = 9; // COMMAND, be16 PING, be16 4, be32 value

} // namespace

Status Loader::load_command()
{
    uint16_t cmd = f_->get_be16();
    uint16_t len = f_->get_be16();
    QMIGD_TRY(stream_status());
    if (cmd == MIG_CMD_INVALID || cmd >= MIG_CMD_MAX) {
        return fail(fmt::format("MIG_CMD 0x{:x} unknown (len 0x{:x})", cmd, len));
    }
    const MessageArgs &args = kCommands[cmd];
    if (args.len != -1 && args.len != len) {
        return fail(fmt::format("{} received with bad length - expecting {}, got {}", args.name,
                                args.len, len));
    }
    switch (cmd) {
    case MIG_CMD_OPEN_RETURN_PATH:
        if (return_path_) {
            return fail("CMD_OPEN_RETURN_PATH called when RP already open");
        }
        return_path_ = true;
        return h_.open_return_path();
    case MIG_CMD_PING: {
        uint32_t value = f_->get_be32();
        QMIGD_TRY(stream_status());
        if (!return_path_) {
            return fail(fmt::format("CMD_PING (0x{:x}) received with no return path", value));
        }
        return h_.ping(value);
    }
    case MIG_CMD_SWITCHOVER_START:
        return {};
    case MIG_CMD_POSTCOPY_ADVISE:
        return postcopy_advise(len);
    case MIG_CMD_POSTCOPY_RAM_DISCARD:
        return postcopy_discard(len);
    case MIG_CMD_PACKAGED:
        return load_packaged();
    case MIG_CMD_POSTCOPY_LISTEN:
        return postcopy_listen();
    case MIG_CMD_POSTCOPY_RUN:
        return postcopy_run();
    case MIG_CMD_RECV_BITMAP:
        return recv_bitmap(len);
    case MIG_CMD_POSTCOPY_RESUME:
        return postcopy_resume();
    default:
        return fail(fmt::format("MIG_CMD 0x{:x} is not supported by qmigd (COLO is not "
                                "implemented)",
                                cmd));
    }
}

// loadvm_postcopy_handle_advise(). A qmigd destination writes pages with
// plain stores, so any page size would do; but a block whose page size is
// not 4096 carries it in the RAM list, which only the block's own page
// size announces: the summaries must match, as in QEMU. A parked VM's
// blocks come from the stream, their page sizes unknown: 4 KiB only.
Status Loader::postcopy_advise(uint16_t len)
{
    if (postcopy_ != PostcopyState::None) {
        return fail(fmt::format("CMD_POSTCOPY_ADVISE in wrong postcopy state ({})",
                                int(postcopy_)));
    }
    postcopy_ = PostcopyState::Advise;
    if (len == 0) { // dirty bitmaps only
        if (cfg_.postcopy_ram) {
            return fail("RAM postcopy is enabled but have 0 byte advise");
        }
        return {};
    }
    if (len != 16) {
        return fail(fmt::format("CMD_POSTCOPY_ADVISE invalid length ({})", len));
    }
    if (!cfg_.postcopy_ram) {
        return fail("RAM postcopy is disabled but have 16 byte advise");
    }
    uint64_t summary = f_->get_be64();
    uint64_t tps = f_->get_be64();
    QMIGD_TRY(stream_status());
    uint64_t local = cfg_.park ? TARGET_PAGE_SIZE : 0;
    for (const auto &b : blocks_) {
        local |= b.page_size;
    }
    if (summary != local) {
        return fail(fmt::format("Postcopy needs matching RAM page sizes (s={:x} d={:x})", summary,
                                local));
    }
    if (tps != TARGET_PAGE_SIZE) {
        return fail(fmt::format("Postcopy needs matching target page sizes (s={} d={})",
                                int(tps), TARGET_PAGE_SIZE));
    }
    return {};
}

// loadvm_postcopy_ram_handle_discard(): version, block name, nil, then
// (be64 start, be64 length) ranges, each inside the block.
Status Loader::postcopy_discard(uint16_t len)
{
    if (postcopy_ != PostcopyState::Advise && postcopy_ != PostcopyState::Discard) {
        return fail(fmt::format("CMD_POSTCOPY_RAM_DISCARD in wrong postcopy state ({})",
                                int(postcopy_)));
    }
    postcopy_ = PostcopyState::Discard;
    if (len < 1 + 1 + 1 + 1 + 2 * 8) {
        return fail(fmt::format("CMD_POSTCOPY_RAM_DISCARD invalid length ({})", len));
    }
    uint8_t version = f_->get_byte();
    QMIGD_TRY(stream_status());
    if (version != 0) {
        return fail(fmt::format("CMD_POSTCOPY_RAM_DISCARD invalid version ({})", version));
    }
    std::string ramid = f_->get_cstr8();
    if (f_->failed()) {
        return fail("CMD_POSTCOPY_RAM_DISCARD Failed to read RAMBlock ID");
    }
    uint8_t nil = f_->get_byte();
    QMIGD_TRY(stream_status());
    if (nil != 0) {
        return fail(fmt::format("CMD_POSTCOPY_RAM_DISCARD missing nil ({})", nil));
    }
    const size_t body = size_t(len) - 3; // len >= 20 here
    size_t rest = body >= ramid.size() ? body - ramid.size() : 1; // 1: not whole ranges
    if (rest % 16) {
        return fail(fmt::format("CMD_POSTCOPY_RAM_DISCARD invalid length ({})", rest));
    }
    size_t block = 0;
    while (block < blocks_.size() && blocks_[block].idstr != ramid) {
        block++;
    }
    if (block == blocks_.size()) {
        return fail(fmt::format("ram_discard_range: Failed to find block '{}'", wire_text(ramid)));
    }
    const uint64_t used = blocks_[block].used_length;
    for (; rest; rest -= 16) {
        uint64_t start = f_->get_be64();
        uint64_t length = f_->get_be64();
        QMIGD_TRY(stream_status());
        if (start % TARGET_PAGE_SIZE) {
            return fail(fmt::format("ram_block_discard_range: Unaligned start address: 0x{:x}",
                                    start));
        }
        if (start > used || length > used - start) {
            return fail(fmt::format("ram_block_discard_range: Overrun block '{}' ({}/{:x}/{:x})",
                                    wire_text(ramid), start, length, used));
        }
        if (length % TARGET_PAGE_SIZE) {
            return fail(fmt::format("ram_block_discard_range: Unaligned length: {:x}", length));
        }
        QMIGD_TRY(h_.discard_range(block, start, length));
    }
    return {};
}

Status Loader::postcopy_listen()
{
    if (postcopy_ != PostcopyState::Advise && postcopy_ != PostcopyState::Discard) {
        return fail(fmt::format("CMD_POSTCOPY_LISTEN in wrong postcopy state ({})",
                                int(postcopy_)));
    }
    postcopy_ = PostcopyState::Listening;
    h_.postcopy_listening();
    return {};
}

Status Loader::postcopy_run()
{
    if (postcopy_ != PostcopyState::Listening) {
        return fail(fmt::format("CMD_POSTCOPY_RUN in wrong postcopy state ({})", int(postcopy_)));
    }
    postcopy_ = PostcopyState::Running;
    result_.postcopy = true;
    return {};
}

// loadvm_handle_cmd_packaged(): be32 length, then a stream of its own
// that the destination reads whole before acting on it.
Status Loader::load_packaged()
{
    uint32_t length = f_->get_be32();
    QMIGD_TRY(stream_status());
    if (in_package_) {
        return fail("CMD_PACKAGED inside a package");
    }
    if (length > kMaxDeviceState) {
        return fail(fmt::format("Unreasonably large packaged state: {}", length));
    }
    // Filled as the bytes come: a peer that announces 64 MiB and stalls
    // holds only the pages it sent (reserved memory is not touched).
    constexpr size_t kChunk = 1 << 20;
    std::vector<uint8_t> package;
    package.reserve(length);
    while (package.size() < length && !f_->failed()) {
        size_t at = package.size();
        package.resize(at + std::min<size_t>(kChunk, length - at));
        f_->get_buffer(package.data() + at, package.size() - at);
    }
    if (f_->failed()) {
        return Error(f_->error()).prepend("CMD_PACKAGED: Buffer receive fail: ");
    }
    if (cfg_.park) {
        return park_package(package);
    }
    MemoryInputStream in(package.data(), package.size());
    QEMUFileReader pf(in);
    QEMUFileReader *main = f_;
    f_ = &pf;
    in_package_ = true;
    Status st = load_package(pf);
    f_ = main;
    in_package_ = false;
    return st;
}

// The package's own records, until RUN: commands and device sections
// (anything after RUN is ignored, as QEMU's LOADVM_QUIT does).
Status Loader::load_package(QEMUFileReader &pf)
{
    while (postcopy_ != PostcopyState::Running) {
        if (pf.peek_byte() < 0) {
            QMIGD_TRY(stream_status());
            return fail("CMD_PACKAGED: the package ended before POSTCOPY_RUN");
        }
        uint8_t type = pf.get_byte();
        if (type == QEMU_VM_COMMAND) {
            QMIGD_TRY(load_command());
        } else if (type == QEMU_VM_SECTION_FULL) {
            QMIGD_TRY(load_section_start(type));
        } else {
            return fail(fmt::format("Unexpected section type {} in a postcopy package", type));
        }
    }
    return {};
}

// Park mode: device sections carry no length, so the package is taken
// apart from its ends -- LISTEN first, RUN last, and the PING that QEMU
// puts before RUN -- and what lies between is kept as the device state.
Status Loader::park_package(const std::vector<uint8_t> &package)
{
    QMIGD_TRY(park_check_ram());
    const size_t n = package.size();
    if (n < sizeof(kListen) + sizeof(kRun) ||
        std::memcmp(package.data(), kListen, sizeof(kListen)) != 0 ||
        std::memcmp(package.data() + n - sizeof(kRun), kRun, sizeof(kRun)) != 0) {
        return fail("qmigd cannot park this VM: its postcopy package is not POSTCOPY_LISTEN, "
                    "device sections, POSTCOPY_RUN");
    }
    size_t end = n - sizeof(kRun);
    const uint8_t *ping =
        end >= sizeof(kListen) + kPingSize ? package.data() + end - kPingSize : nullptr;
    bool has_ping = ping && ping[0] == QEMU_VM_COMMAND && get_be16(ping + 1) == MIG_CMD_PING &&
                    get_be16(ping + 3) == 4;
    if (has_ping) {
        end -= kPingSize;
    }
    const uint8_t *sections = package.data() + sizeof(kListen);
    size_t sections_len = end - sizeof(kListen);
    if (sections_len && sections[0] != QEMU_VM_SECTION_FULL) {
        return fail("qmigd cannot park this VM: its postcopy package holds more than device "
                    "sections");
    }
    QMIGD_TRY(postcopy_listen());
    if (has_ping) {
        if (!return_path_) {
            return fail(fmt::format("CMD_PING (0x{:x}) received with no return path",
                                    get_be32(ping + 5)));
        }
        QMIGD_TRY(h_.ping(get_be32(ping + 5)));
    }
    QMIGD_TRY(postcopy_run());
    std::vector<uint8_t> &ds = result_.device_state;
    ds.assign(sections, sections + sections_len);
    ByteWriter w(ds);
    // The package has no VM description (destinations read and discard
    // it): the record gets one of qmigd's that says where its sections end.
    std::string vmdesc = device_state_packaged_vmdesc(sections_len);
    w.u8(QEMU_VM_EOF);
    w.u8(QEMU_VM_VMDESCRIPTION);
    w.be32(uint32_t(vmdesc.size()));
    w.bytes(vmdesc.data(), vmdesc.size());
    return device_state_check(ds).status();
}

// loadvm_handle_recv_bitmap(): a resumed source asks which pages of a
// block we have; the answer goes on the return path.
Status Loader::recv_bitmap(uint16_t len)
{
    std::string name = f_->get_cstr8();
    QMIGD_TRY(stream_status());
    if (name.empty()) {
        return fail("loadvm_handle_recv_bitmap: failed to read block name");
    }
    if (len != name.size() + 1) {
        return fail(fmt::format("loadvm_handle_recv_bitmap: invalid payload length ({})", len));
    }
    if (!recovering_) {
        return fail("MSG_RP_RECV_BITMAP only used for recovery");
    }
    for (size_t i = 0; i < blocks_.size(); i++) {
        if (blocks_[i].idstr == name) {
            return h_.send_recv_bitmap(i);
        }
    }
    return fail(fmt::format("loadvm_handle_recv_bitmap: block '{}' not found", wire_text(name)));
}

// loadvm_postcopy_handle_resume(): QEMU ignores one outside a recovery.
Status Loader::postcopy_resume()
{
    if (!recovering_) {
        return {};
    }
    recovering_ = false;
    return h_.postcopy_resume();
}

} // namespace qmigd
