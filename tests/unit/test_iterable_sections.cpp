// What the loader makes of the other capabilities' records: XBZRLE pages,
// x-ignore-shared's RAM list and configuration, dirty-bitmap sections
// (read through, or kept when parking, and read back from a parked VM).
#include <catch2/catch.hpp>

#include <cstring>

#include "tests/unit/fake_loader.h"
#include "protocol/dirty_bitmap_section.h"
#include "protocol/iterable_state.h"
#include "protocol/loadvm.h"
#include "protocol/savevm.h"
#include "protocol/xbzrle.h"

using namespace qmigd;

namespace {

constexpr uint64_t kBlockSize = 8 * TARGET_PAGE_SIZE;
const RamBlockDesc kMem{"mem", kBlockSize};

struct Ram : FakeLoader {
    Ram() : FakeLoader(kBlockSize, 0x11) {}
};

std::vector<uint8_t> bytes_of(std::initializer_list<int> v)
{
    std::vector<uint8_t> out;
    out.reserve(64); // room to grow: GCC 12 warns (falsely) on appends to a 2-byte vector
    for (int x : v) {
        out.push_back(uint8_t(x));
    }
    return out;
}

// A dirty-bitmap START body as QEMU 10 sends it (captured): START with
// both names, granularity 64 KiB, enabled + persistent, EOS.
std::vector<uint8_t> bitmap_start_body()
{
    std::vector<uint8_t> b;
    b.reserve(64); // GCC 12 warns (falsely) on ByteWriter appends to an empty vector
    ByteWriter w(b);
    w.u8(0x1c);
    w.cstr8("disk0");
    w.cstr8("bm0");
    w.be32(65536);
    w.u8(0x03);
    w.u8(0x01);
    return b;
}

// Its END: bits of 16 bytes, zeroes, COMPLETE, EOS.
std::vector<uint8_t> bitmap_end_body()
{
    std::vector<uint8_t> b;
    b.reserve(64);
    ByteWriter w(b);
    w.u8(0x40);
    w.be64(0);
    w.be32(128);
    w.be64(16);
    for (int i = 0; i < 16; i++) {
        w.u8(uint8_t(i));
    }
    w.u8(0x42);
    w.be64(128);
    w.be32(1000);
    w.u8(0x20);
    w.u8(0x01);
    return b;
}

struct Stream {
    std::vector<uint8_t> out;
    ByteWriter w{out};
    RamRecordEncoder rec;

    void start(RamListOptions opts = {}, std::span<const std::string_view> caps = {})
    {
        savevm_put_header(w);
        savevm_put_configuration(w, "none", nullptr, caps);
        savevm_put_section_header(w, QEMU_VM_SECTION_START, 1, "ram", 0, 4);
        ram_put_mem_size(w, std::span(&kMem, 1), opts);
        ram_put_flag(w, RAM_SAVE_FLAG_EOS);
        savevm_put_footer(w, 1);
    }
    void bitmap_section(uint8_t type, const std::vector<uint8_t> &body)
    {
        if (type == QEMU_VM_SECTION_START) {
            savevm_put_section_header(w, type, 2, "dirty-bitmap", 0, 1);
        } else {
            savevm_put_section_continue(w, type, 2);
        }
        w.bytes(body.data(), body.size());
        savevm_put_footer(w, 2);
    }
    void xbzrle_part(uint64_t offset, const std::vector<uint8_t> &delta, uint8_t encoding = 1)
    {
        savevm_put_section_continue(w, QEMU_VM_SECTION_PART, 1);
        rec.reset();
        std::vector<uint8_t> hdr;
        hdr.reserve(64);
        ByteWriter h(hdr);
        h.be64(offset | RAM_SAVE_FLAG_XBZRLE);
        h.cstr8("mem");
        h.u8(encoding);
        h.be16(uint16_t(delta.size()));
        w.bytes(hdr.data(), hdr.size());
        w.bytes(delta.data(), delta.size());
        ram_put_flag(w, RAM_SAVE_FLAG_EOS);
        savevm_put_footer(w, 1);
    }
    void end()
    {
        savevm_put_section_continue(w, QEMU_VM_SECTION_END, 1);
        ram_put_flag(w, RAM_SAVE_FLAG_EOS);
        savevm_put_footer(w, 1);
    }
};

Result<LoadvmResult> load(const std::vector<uint8_t> &s, Ram &ram, const LoadvmConfig &cfg)
{
    MemoryInputStream in(s.data(), s.size());
    QEMUFileReader f(in, 64);
    return qemu_loadvm_state(f, cfg, ram);
}

LoadvmConfig plain()
{
    LoadvmConfig c;
    c.blocks = {kMem};
    return c;
}

std::string error_of(const Result<LoadvmResult> &r)
{
    return r ? std::string() : r.error().message();
}

} // namespace

TEST_CASE("loader: an XBZRLE record changes the page as it is", "[xbzrle]")
{
    Stream s;
    s.start();
    s.xbzrle_part(2 * TARGET_PAGE_SIZE, bytes_of({10, 3, 1, 2, 3}));
    s.end();
    s.w.u8(QEMU_VM_EOF);
    Ram ram;
    auto r = load(s.out, ram, plain());
    REQUIRE(r);
    CHECK(r->xbzrle_pages == 1);
    std::vector<uint8_t> want(TARGET_PAGE_SIZE, 0x11);
    want[10] = 1, want[11] = 2, want[12] = 3;
    CHECK(std::memcmp(ram.ram.data() + 2 * TARGET_PAGE_SIZE, want.data(), want.size()) == 0);
    CHECK(std::all_of(ram.ram.begin(), ram.ram.begin() + 2 * TARGET_PAGE_SIZE,
                      [](uint8_t x) { return x == 0x11; }));
}

TEST_CASE("loader: XBZRLE refusals in QEMU's words", "[xbzrle]")
{
    auto with = [](const std::vector<uint8_t> &delta, uint8_t encoding, uint64_t offset = 0) {
        Stream s;
        s.start();
        s.xbzrle_part(offset, delta, encoding);
        Ram ram;
        return error_of(load(s.out, ram, plain()));
    };
    CHECK(with(bytes_of({10, 3, 1, 2, 3}), 2) == "Failed to load XBZRLE page - wrong compression!");
    CHECK(with(std::vector<uint8_t>(4097, 1), 1) == "Failed to load XBZRLE page - len overflow!");
    CHECK(with(bytes_of({10, 0}), 1) == "Failed to load XBZRLE page - decode error!");
    CHECK(with(bytes_of({10, 3, 1, 2, 3}), 1, kBlockSize) == "Illegal RAM offset 8000");
}

TEST_CASE("loader: x-ignore-shared's RAM list and capability", "[ignore-shared]")
{
    static constexpr std::string_view kIgnore[] = {"x-ignore-shared"};
    auto run = [](bool source, bool dest, uint64_t local_addr) {
        Stream s;
        s.start({false, source}, source ? std::span<const std::string_view>(kIgnore)
                                        : std::span<const std::string_view>());
        s.end();
        s.w.u8(QEMU_VM_EOF);
        LoadvmConfig cfg = plain();
        cfg.ignore_shared = dest;
        cfg.blocks[0].addr = local_addr;
        Ram ram;
        return error_of(load(s.out, ram, cfg));
    };
    CHECK(run(true, true, 0).empty());
    CHECK(run(true, true, 4096) == "Mismatched GPAs for block mem 0!= 4096");
    CHECK(run(false, true, 0) == "Capability x-ignore-shared is on, but received capability is off");
    CHECK(run(true, false, 0) == "Capability x-ignore-shared is off, but received capability is on");
}

TEST_CASE("dirty-bitmap sections: read through, or kept whole when parking", "[dirty-bitmaps]")
{
    Stream s;
    s.start();
    s.bitmap_section(QEMU_VM_SECTION_START, bitmap_start_body());
    s.end();
    s.bitmap_section(QEMU_VM_SECTION_END, bitmap_end_body());
    size_t device_at = s.out.size();
    savevm_put_timer(s.w, 0);
    savevm_put_eof_and_vmdesc(s.w);
    Ram ram;
    auto r = load(s.out, ram, plain());
    REQUIRE(r);
    CHECK(r->iterable_state.empty()); // no disks here: nothing kept
    LoadvmConfig park;
    park.park = true;
    Ram parked;
    r = load(s.out, parked, park);
    REQUIRE(r);
    CHECK(r->device_state.size() == s.out.size() - device_at);
    auto split = iterable_state_split(r->iterable_state);
    REQUIRE(split);
    REQUIRE(split->size() == 2);
    CHECK((*split)[0].type == QEMU_VM_SECTION_START);
    CHECK((*split)[1].type == QEMU_VM_SECTION_END);
    // The START section as it came: header, the body, the footer.
    std::vector<uint8_t> start;
    ByteWriter w(start);
    savevm_put_section_header(w, QEMU_VM_SECTION_START, 2, "dirty-bitmap", 0, 1);
    auto body = bitmap_start_body();
    w.bytes(body.data(), body.size());
    savevm_put_footer(w, 2);
    CHECK(std::vector<uint8_t>((*split)[0].bytes.begin(), (*split)[0].bytes.end()) == start);
}

TEST_CASE("dirty-bitmap sections: refusals", "[dirty-bitmaps]")
{
    auto with = [](std::vector<uint8_t> body) {
        Stream s;
        s.start();
        s.bitmap_section(QEMU_VM_SECTION_START, body);
        Ram ram;
        return error_of(load(s.out, ram, plain()));
    };
    auto reserved = bitmap_start_body();
    reserved[1 + 6 + 4 + 4] = 0x08; // the start flags byte
    CHECK(with(reserved) == "Unknown flags in migrated dirty bitmap header: 8");
    std::vector<uint8_t> big;
    big.reserve(64);
    ByteWriter w(big);
    w.u8(0x40);
    w.be64(0);
    w.be32(8);
    w.be64(10 * 1024 + 1);
    CHECK(with(big) == "Bitmap migration stream buffer allocation request is too large");
    CHECK(with(bytes_of({0x1c, 5})).rfind("dirty-bitmap section: ", 0) == 0); // cut short
}

TEST_CASE("iterable state read back: every length and section checked", "[dirty-bitmaps]")
{
    std::vector<uint8_t> state, section;
    ByteWriter w(section);
    savevm_put_section_continue(w, QEMU_VM_SECTION_END, 2);
    auto body = bitmap_end_body();
    w.bytes(body.data(), body.size());
    savevm_put_footer(w, 2);
    REQUIRE(iterable_state_append(state, section));
    CHECK(iterable_state_split(state));
    auto broken = [&](auto mutate) {
        std::vector<uint8_t> s = state;
        mutate(s);
        auto r = iterable_state_split(s);
        return r ? std::string() : r.error().message();
    };
    CHECK(broken([](auto &s) { s.pop_back(); }) == "iterable sections cut short");
    CHECK(broken([](auto &s) { s.push_back(0); }) == "iterable sections cut short");
    CHECK(broken([](auto &s) { s[4] = QEMU_VM_SECTION_FULL; }) ==
          "iterable sections: kept section of type 4 is not iterable");
    CHECK(broken([](auto &s) { s[s.size() - 1] = 9; }) ==
          "iterable sections: kept section without its footer");
    CHECK(broken([](auto &s) { s[3] = uint8_t(s[3] + 1), s.push_back(0); }) ==
          "iterable sections: kept section with bytes after its footer");
    std::vector<uint8_t> huge(kMaxIterableState - 2, 0);
    CHECK_FALSE(iterable_state_append(huge, section));
}
