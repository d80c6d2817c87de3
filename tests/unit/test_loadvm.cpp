// Main-channel decoding: streams built with our encoders (and by hand)
// into the loader, including malformed ones.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>

#include "tests/unit/fake_loader.h"
#include "protocol/loadvm.h"
#include "protocol/return_path.h"
#include "protocol/savevm.h"

using namespace qmigd;

namespace {

constexpr uint64_t kBlockSize = 16 * TARGET_PAGE_SIZE;

struct FakeRam : FakeLoader {
    FakeRam() : FakeLoader(kBlockSize, 0xAA) {}
};

LoadvmConfig config(bool multifd = false)
{
    LoadvmConfig c;
    c.blocks = {{"mem", kBlockSize}};
    c.multifd = multifd;
    return c;
}

Result<LoadvmResult> load(const std::vector<uint8_t> &bytes, FakeRam &ram,
                          const LoadvmConfig &cfg = config())
{
    MemoryInputStream in(bytes.data(), bytes.size());
    QEMUFileReader f(in, 64);
    return qemu_loadvm_state(f, cfg, ram);
}

// A complete stream: one PAGE of `fill` at page 1, a ZERO page at 2.
std::vector<uint8_t> good_stream(uint8_t fill = 0x5A, bool flush = false)
{
    std::vector<uint8_t> out;
    ByteWriter w(out);
    RamBlockDesc mem{"mem", kBlockSize};
    RamRecordEncoder rec;
    savevm_put_header(w);
    savevm_put_configuration(w, "none");
    savevm_put_section_header(w, QEMU_VM_SECTION_START, 1, "ram", 0, 4);
    ram_put_mem_size(w, std::span(&mem, 1));
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
    savevm_put_section_continue(w, QEMU_VM_SECTION_PART, 1);
    rec.put_page_header(w, mem, 1 * TARGET_PAGE_SIZE);
    w.zeros(0);
    std::vector<uint8_t> page(TARGET_PAGE_SIZE, fill);
    w.bytes(page.data(), page.size());
    rec.put_zero_page(w, mem, 2 * TARGET_PAGE_SIZE);
    if (flush) {
        ram_put_flag(w, RAM_SAVE_FLAG_MULTIFD_FLUSH);
    }
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
    put_stream_end(w);
    return out;
}

std::string load_error(const std::vector<uint8_t> &bytes, const LoadvmConfig &cfg = config())
{
    FakeRam ram;
    auto r = load(bytes, ram, cfg);
    REQUIRE_FALSE(r.ok());
    return r.error().message();
}

// Offset of the first occurrence of a byte pattern.
size_t find(const std::vector<uint8_t> &s, std::initializer_list<uint8_t> pat)
{
    std::vector<uint8_t> p(pat);
    auto it = std::search(s.begin(), s.end(), p.begin(), p.end());
    REQUIRE(it != s.end());
    return size_t(it - s.begin());
}


} // namespace

// Shared with test_park.cpp.
std::vector<uint8_t> loadvm_test_good_stream(uint8_t fill) { return good_stream(fill); }

TEST_CASE("a complete stream loads pages, zero pages and the run state", "[loadvm]")
{
    FakeRam ram;
    auto r = load(good_stream(0x5A), ram);
    REQUIRE(r.ok());
    CHECK(r->normal_pages == 1);
    CHECK(r->zero_pages == 1);
    CHECK(r->runstate == "running");
    CHECK(ram.ram[TARGET_PAGE_SIZE] == 0x5A);
    CHECK(ram.ram[2 * TARGET_PAGE_SIZE - 1] == 0x5A);
    CHECK(ram.ram[2 * TARGET_PAGE_SIZE] == 0);          // zero page overwrote 0xAA
    CHECK(ram.ram[3 * TARGET_PAGE_SIZE - 1] == 0);
    CHECK(ram.ram[0] == 0xAA);                          // untouched page
}

TEST_CASE("the encoder's bytes match QEMU's captured layout", "[savevm]")
{
    auto s = good_stream();
    const uint8_t head[] = {0x51, 0x45, 0x56, 0x4d, 0, 0, 0, 3, 0x07, 0, 0, 0, 4, 'n', 'o', 'n', 'e',
                            0x01, 0, 0, 0, 1, 3, 'r', 'a', 'm', 0, 0, 0, 0, 0, 0, 0, 4};
    REQUIRE(s.size() > sizeof(head));
    CHECK(std::equal(head, head + sizeof(head), s.begin()));
    // Timer FULL record is 48 bytes, globalstate 134, VMDESC length 823.
    size_t t = find(s, {0x04, 0, 0, 0, 0, 5, 't', 'i', 'm', 'e', 'r'});
    CHECK(s[t + 43] == 0x7e);
    size_t g = find(s, {0x04, 0, 0, 0, 3, 11, 'g', 'l', 'o', 'b'});
    CHECK(g == t + 48);
    CHECK(s[g + 134] == QEMU_VM_EOF);
    CHECK(s[g + 135] == QEMU_VM_VMDESCRIPTION);
    CHECK(get_be32(&s[g + 136]) == 823);
    CHECK(s.size() == g + 140 + 823);
}

TEST_CASE("MULTIFD_FLUSH reaches the handler only with multifd on", "[loadvm]")
{
    FakeRam ram;
    auto r = load(good_stream(1, true), ram, config(true));
    REQUIRE(r.ok());
    CHECK(ram.flushes == 1);
    CHECK(load_error(good_stream(1, true)).starts_with(
        "MULTIFD_FLUSH received but multifd is off here: the source has"));
}

TEST_CASE("header and configuration errors", "[loadvm]")
{
    auto s = good_stream();
    SECTION("wrong magic")
    {
        s[0] = 'X';
        CHECK(load_error(s).rfind("Not a migration stream", 0) == 0);
    }
    SECTION("version 2 is obsolete")
    {
        s[7] = 2;
        CHECK(load_error(s) == "SaveVM v2 format is obsolete and don't work anymore");
    }
    SECTION("version 4 is unsupported")
    {
        s[7] = 4;
        CHECK(load_error(s) == "Unsupported migration stream version 4");
    }
    SECTION("configuration missing")
    {
        s[8] = QEMU_VM_SECTION_START;
        CHECK(load_error(s) == "Configuration section missing");
    }
    SECTION("machine type mismatch, including a prefix")
    {
        auto cfg = config();
        cfg.machine_type = "pc";
        CHECK(load_error(s, cfg) == "Machine type received is 'none' and local is 'pc'");
        cfg.machine_type = "nonexistent";
        CHECK(load_error(s, cfg).find("Machine type received is 'none'") == 0);
    }
    SECTION("huge machine type length")
    {
        s[9] = 0x7f;
        CHECK(load_error(s).find("Machine type name too long") == 0);
    }
}

TEST_CASE("configuration/uuid is checked when both sides have one", "[loadvm]")
{
    std::vector<uint8_t> s;
    ByteWriter w(s);
    Uuid u{};
    u[0] = 0x12;
    savevm_put_header(w);
    savevm_put_configuration(w, "none", &u);
    w.u8(QEMU_VM_EOF);
    FakeRam ram;
    auto cfg = config();
    CHECK(load(s, ram, cfg).ok()); // we have no uuid: accepted
    cfg.uuid[0] = 0x34;
    CHECK(load_error(s, cfg).find("UUID received is 12000000") == 0);
    cfg.uuid = u;
    CHECK(load(s, ram, cfg).ok());
}

TEST_CASE("section errors", "[loadvm]")
{
    auto s = good_stream();
    size_t start = find(s, {0x01, 0, 0, 0, 1, 3, 'r', 'a', 'm'});
    SECTION("unknown section")
    {
        s[start + 6] = 'x';
        CHECK(load_error(s).find("Unknown savevm section or instance 'xam' 0") == 0);
    }
    SECTION("wrong ram version")
    {
        s[start + 16] = 3;
        CHECK(load_error(s).find("savevm: unsupported version 3 for 'ram'") == 0);
    }
    SECTION("unknown section type")
    {
        s[start] = 0x42;
        CHECK(load_error(s) == "Unknown savevm section type 66");
    }
    SECTION("PART for a section never started")
    {
        size_t part = find(s, {0x02, 0, 0, 0, 1});
        s[part + 4] = 9;
        CHECK(load_error(s) == "Unknown savevm section 9");
    }
    SECTION("missing footer")
    {
        size_t footer = find(s, {0x7e, 0, 0, 0, 1});
        s[footer] = 0x7d;
        CHECK(load_error(s) == "Missing section footer for ram");
    }
    SECTION("mismatched footer")
    {
        size_t footer = find(s, {0x7e, 0, 0, 0, 1});
        s[footer + 4] = 2;
        CHECK(load_error(s) ==
              "Mismatched section id in footer for ram - read 0x2 expected 0x1");
    }
    SECTION("unknown command")
    {
        size_t cmd = find(s, {0x08, 0, 0x0b, 0, 0});
        s[cmd + 2] = 0x0c;
        CHECK(load_error(s) == "MIG_CMD 0xc unknown (len 0x0)");
        s[cmd + 2] = 0x08; // ENABLE_COLO
        CHECK(load_error(s).find("MIG_CMD 0x8 is not supported") == 0);
        s[cmd + 2] = 0x07; // PACKAGED, whose length is 4
        CHECK(load_error(s) == "PACKAGED received with bad length - expecting 4, got 0");
        s[cmd + 2] = 0x01; // OPEN_RETURN_PATH, to a handler without one
        CHECK(load_error(s) == "this destination has no return path");
    }
    SECTION("bad globalstate runstate")
    {
        size_t g = find(s, {'r', 'u', 'n', 'n', 'i', 'n', 'g'});
        s[g] = 'x';
        CHECK(load_error(s) == "globalstate: unknown runstate 'xunning'");
    }
}

TEST_CASE("ram record errors", "[loadvm]")
{
    auto s = good_stream();
    size_t mem_size = find(s, {0, 0, 0, 0, 0, 1, 0, 4, 3, 'm', 'e', 'm'});
    SECTION("unknown block in the RAM list")
    {
        s[mem_size + 9] = 'x';
        CHECK(load_error(s) == "Unknown ramblock \"xem\", cannot accept migration");
    }
    SECTION("size mismatch")
    {
        auto cfg = config();
        cfg.blocks[0].used_length = 2 * kBlockSize;
        CHECK(load_error(s, cfg) == "Size mismatch: mem: 0x10000 != 0x20000: Invalid argument");
    }
    SECTION("block list longer than the total")
    {
        s[mem_size + 5] = 0; // total 0x000 -> nothing, then the block is parsed as a record
        CHECK_FALSE(load_error(s).empty());
    }
    SECTION("page offset beyond the block")
    {
        size_t page = find(s, {0, 0, 0, 0, 0, 0, 0x10, 0x08, 3, 'm', 'e', 'm'});
        s[page + 5] = 0x01; // offset 0x11000 > 0x10000
        CHECK(load_error(s) == "Illegal RAM offset 11000");
    }
    SECTION("zero page with a non-zero fill byte")
    {
        size_t z = find(s, {0, 0, 0, 0, 0, 0, 0x20, 0x22, 0});
        s[z + 8] = 7;
        CHECK(load_error(s) == "Found a zero page with value 7");
    }
    SECTION("CONTINUE before any block")
    {
        size_t page = find(s, {0, 0, 0, 0, 0, 0, 0x10, 0x08, 3, 'm', 'e', 'm'});
        s[page + 7] |= RAM_SAVE_FLAG_CONTINUE;
        CHECK(load_error(s) == "Ack, bad migration stream!");
    }
    SECTION("unknown flag combination")
    {
        size_t z = find(s, {0, 0, 0, 0, 0, 0, 0x20, 0x22, 0});
        s[z + 7] = 0x2a; // ZERO|PAGE|CONTINUE
        CHECK(load_error(s) == "Unknown combination of migration flags: 0x2a");
    }
    SECTION("unknown block in a page record")
    {
        size_t page = find(s, {0, 0, 0, 0, 0, 0, 0x10, 0x08, 3, 'm', 'e', 'm'});
        s[page + 9] = 'x';
        CHECK(load_error(s) == "Can't find block xem");
    }
}

TEST_CASE("every truncation of a good stream fails cleanly", "[loadvm]")
{
    auto s = good_stream();
    // Everything before the EOF marker is required.
    size_t eof = s.size() - 823 - 5 - 1;
    for (size_t len = 0; len < eof; len++) {
        std::vector<uint8_t> cut(s.begin(), s.begin() + long(len));
        FakeRam ram;
        auto r = load(cut, ram);
        INFO("length " << len);
        REQUIRE_FALSE(r.ok());
    }
}

TEST_CASE("random bytes after a good header never crash the loader", "[loadvm]")
{
    std::mt19937 rng(42);
    auto good = good_stream();
    for (int round = 0; round < 2000; round++) {
        auto s = good;
        // Flip a few bytes somewhere in the stream.
        for (int k = 0; k < 3; k++) {
            s[rng() % s.size()] = uint8_t(rng());
        }
        FakeRam ram;
        (void)load(s, ram); // FakeRam's REQUIREs catch any out-of-range access
    }
}

// A destination with a return path: what it was asked to send.
struct ReturnPathRam : FakeRam {
    int opened = 0;
    std::vector<uint32_t> pongs;
    Status open_return_path() override
    {
        opened++;
        return {};
    }
    Status ping(uint32_t value) override
    {
        pongs.push_back(value);
        return {};
    }
};

// good_stream() with `commands` right after the configuration section.
std::vector<uint8_t> with_commands(const std::vector<uint8_t> &commands)
{
    auto s = good_stream();
    size_t at = find(s, {QEMU_VM_SECTION_START, 0, 0, 0, 1});
    s.insert(s.begin() + long(at), commands.begin(), commands.end());
    return s;
}

TEST_CASE("return path commands", "[loadvm][return-path]")
{
    std::vector<uint8_t> cmds;
    ByteWriter w(cmds);
    SECTION("open, then ping")
    {
        savevm_put_command(w, MIG_CMD_OPEN_RETURN_PATH);
        savevm_put_ping(w, RP_PING_OPEN);
        savevm_put_ping(w, 7);
        ReturnPathRam ram;
        auto bytes = with_commands(cmds);
        MemoryInputStream in2(bytes.data(), bytes.size());
        QEMUFileReader f(in2, 64);
        REQUIRE(qemu_loadvm_state(f, config(), ram).ok());
        CHECK(ram.opened == 1);
        CHECK(ram.pongs == std::vector<uint32_t>{1, 7});
    }
    SECTION("ping without a return path")
    {
        savevm_put_ping(w, 9);
        CHECK(load_error(with_commands(cmds)) == "CMD_PING (0x9) received with no return path");
    }
    SECTION("opened twice")
    {
        savevm_put_command(w, MIG_CMD_OPEN_RETURN_PATH);
        savevm_put_command(w, MIG_CMD_OPEN_RETURN_PATH);
        ReturnPathRam ram;
        auto bytes = with_commands(cmds);
        MemoryInputStream in(bytes.data(), bytes.size());
        QEMUFileReader f(in, 64);
        auto r = qemu_loadvm_state(f, config(), ram);
        REQUIRE_FALSE(r.ok());
        CHECK(r.error().message() == "CMD_OPEN_RETURN_PATH called when RP already open");
    }
    SECTION("bad lengths")
    {
        w.u8(QEMU_VM_COMMAND);
        w.be16(MIG_CMD_PING);
        w.be16(3);
        CHECK(load_error(with_commands(cmds)) ==
              "PING received with bad length - expecting 4, got 3");
        cmds.clear();
        w.u8(QEMU_VM_COMMAND);
        w.be16(MIG_CMD_OPEN_RETURN_PATH);
        w.be16(1);
        CHECK(load_error(with_commands(cmds)) ==
              "OPEN_RETURN_PATH received with bad length - expecting 0, got 1");
    }
}

TEST_CASE("return path messages", "[return-path]")
{
    std::vector<uint8_t> out;
    rp_put_shut(out, 1);
    rp_put_pong(out, 0x01020304);
    REQUIRE(out.size() == 16);
    uint16_t type = 0, len = 0;
    REQUIRE(rp_header_decode(out.data(), &type, &len).ok());
    CHECK((type == MIG_RP_MSG_SHUT && len == 4));
    auto m = rp_payload_decode(type, out.data() + 4, len);
    REQUIRE(m.ok());
    CHECK(m->value == 1);
    REQUIRE(rp_header_decode(out.data() + 8, &type, &len).ok());
    CHECK(rp_payload_decode(type, out.data() + 12, len)->value == 0x01020304);

    auto header = [](uint16_t t, uint16_t l) {
        return std::vector<uint8_t>{uint8_t(t >> 8), uint8_t(t), uint8_t(l >> 8), uint8_t(l)};
    };
    CHECK(rp_header_decode(header(0, 4).data(), &type, &len).error().message() ==
          "Received invalid message 0x0000 length 0x0004");
    CHECK(rp_header_decode(header(9, 0).data(), &type, &len).error().message() ==
          "Received invalid message 0x0009 length 0x0000");
    CHECK(rp_header_decode(header(MIG_RP_MSG_SHUT, 5).data(), &type, &len).error().message() ==
          "Received 'SHUT' message (0x0001) withincorrect length 5 expecting 4");
    CHECK_FALSE(rp_header_decode(header(MIG_RP_MSG_REQ_PAGES_ID, 513).data(), &type, &len).ok());
    // REQ_PAGES_ID: the idstr's length byte must match the message.
    std::vector<uint8_t> req(13 + 3, 0);
    req[12] = 3;
    req[13] = 'm', req[14] = 'e', req[15] = 'm';
    auto r = rp_payload_decode(MIG_RP_MSG_REQ_PAGES_ID, req.data(), uint16_t(req.size()));
    REQUIRE(r.ok());
    CHECK(r->idstr == "mem");
    req[12] = 200;
    CHECK(rp_payload_decode(MIG_RP_MSG_REQ_PAGES_ID, req.data(), uint16_t(req.size()))
              .error()
              .message() == "Req_Page_id with length 16 expecting 213");
    std::vector<uint8_t> bm = {5, 'a'};
    CHECK_FALSE(rp_payload_decode(MIG_RP_MSG_RECV_BITMAP, bm.data(), 2).ok());
    CHECK(rp_payload_decode(MIG_RP_MSG_RECV_BITMAP, bm.data(), 0).error().message() ==
          "MIG_RP_MSG_RECV_BITMAP missing block name");
}
