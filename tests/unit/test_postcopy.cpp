// Postcopy on the wire: the source's encoders (discard ranges, ADVISE,
// RAM_DISCARD batches, PACKAGED), the destination's loader on whole
// postcopy streams (plain and parking) and on broken ones, in QEMU's words,
// and the source's page request queue.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <random>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include "tests/unit/fake_loader.h"
#include "daemon/source/page_requests.h"
#include "daemon/source/postcopy_recovery.h"
#include "daemon/dest/return_path.h"
#include "daemon/channel.h"
#include "daemon/source/return_path.h"
#include "daemon/socket_io.h"
#include "ramstate/received_bitmap.h"
#include "protocol/device_state.h"
#include "protocol/loadvm.h"
#include "protocol/postcopy.h"
#include "protocol/return_path.h"
#include "protocol/savevm.h"
#include "waiting.h"

using namespace qmigd;

namespace {

constexpr uint64_t kPages = 16;
constexpr uint64_t kBlockSize = kPages * TARGET_PAGE_SIZE;

// The runs of set bits, one bit at a time.
DiscardRanges naive_ranges(const std::vector<uint64_t> &bm, uint64_t pages)
{
    DiscardRanges out;
    for (uint64_t p = 0; p < pages;) {
        if (!((bm[p / 64] >> (p % 64)) & 1)) {
            p++;
            continue;
        }
        uint64_t s = p;
        while (p < pages && ((bm[p / 64] >> (p % 64)) & 1)) {
            p++;
        }
        out.emplace_back(s * TARGET_PAGE_SIZE, (p - s) * TARGET_PAGE_SIZE);
    }
    return out;
}

struct PostcopyRam : FakeLoader {
    PostcopyRam() : FakeLoader(kBlockSize, 0xAA)
    {
        flush_result = Error("no multifd");
        has_return_path = true;
    }
};

LoadvmConfig postcopy_config(bool park = false)
{
    LoadvmConfig c;
    if (!park) {
        c.blocks = {{"mem", kBlockSize}};
    }
    c.park = park;
    c.postcopy_ram = true;
    return c;
}

const RamBlockDesc kMem{"mem", kBlockSize};

void put_page(ByteWriter &w, RamRecordEncoder &rec, uint64_t page, uint8_t fill)
{
    rec.put_page_header(w, kMem, page * TARGET_PAGE_SIZE);
    std::vector<uint8_t> bytes(TARGET_PAGE_SIZE, fill);
    w.bytes(bytes.data(), bytes.size());
}

std::vector<uint8_t> postcopy_stream(const std::vector<uint8_t> &pkg = postcopy_package())
{
    auto out = postcopy_head(pkg);
    auto tail = postcopy_tail();
    out.insert(out.end(), tail.begin(), tail.end());
    return out;
}

Result<LoadvmResult> load(const std::vector<uint8_t> &bytes, PostcopyRam &ram,
                          const LoadvmConfig &cfg)
{
    MemoryInputStream in(bytes.data(), bytes.size());
    QEMUFileReader f(in, 64);
    return qemu_loadvm_state(f, cfg, ram);
}

std::string load_error(const std::vector<uint8_t> &bytes,
                       const LoadvmConfig &cfg = postcopy_config())
{
    PostcopyRam ram;
    auto r = load(bytes, ram, cfg);
    REQUIRE_FALSE(r.ok());
    return r.error().message();
}

size_t find(const std::vector<uint8_t> &s, std::initializer_list<uint8_t> pat)
{
    std::vector<uint8_t> p(pat);
    auto it = std::search(s.begin(), s.end(), p.begin(), p.end());
    REQUIRE(it != s.end());
    return size_t(it - s.begin());
}

// The stream with the command at `at` replaced by `cmd`.
std::vector<uint8_t> replace_at(std::vector<uint8_t> s, size_t at, size_t old_len,
                                const std::vector<uint8_t> &cmd)
{
    s.erase(s.begin() + long(at), s.begin() + long(at + old_len));
    s.insert(s.begin() + long(at), cmd.begin(), cmd.end());
    return s;
}

std::vector<uint8_t> command(uint16_t cmd, const std::vector<uint8_t> &payload)
{
    std::vector<uint8_t> out;
    ByteWriter w(out);
    w.u8(QEMU_VM_COMMAND);
    w.be16(cmd);
    w.be16(uint16_t(payload.size()));
    w.bytes(payload.data(), payload.size());
    return out;
}

constexpr size_t kAdviseSize = 5 + 16;

} // namespace

TEST_CASE("discard ranges are the runs of the bitmap", "[postcopy]")
{
    std::vector<uint64_t> bm(3, 0);
    CHECK(postcopy_discard_ranges(bm, 150).empty());
    bm = {~uint64_t(0), ~uint64_t(0), (uint64_t(1) << 22) - 1};
    CHECK(postcopy_discard_ranges(bm, 150) ==
          DiscardRanges{{0, 150 * TARGET_PAGE_SIZE}});
    std::mt19937_64 rng(7);
    for (int i = 0; i < 2000; i++) {
        uint64_t pages = 1 + rng() % 300;
        std::vector<uint64_t> r((pages + 63) / 64);
        for (auto &word : r) {
            word = i % 3 == 0 ? rng() : (rng() & rng() & rng()) | (i % 5 ? 0 : ~uint64_t(0) << 40);
        }
        if (pages % 64) {
            r.back() &= (uint64_t(1) << (pages % 64)) - 1;
        }
        REQUIRE(postcopy_discard_ranges(r, pages) == naive_ranges(r, pages));
    }
}

TEST_CASE("RAM_DISCARD commands carry 12 ranges each", "[postcopy]")
{
    DiscardRanges ranges;
    for (uint64_t i = 0; i < 13; i++) {
        ranges.emplace_back(i * 2 * TARGET_PAGE_SIZE, TARGET_PAGE_SIZE);
    }
    std::vector<uint8_t> out;
    ByteWriter w(out);
    savevm_put_postcopy_ram_discard(w, "pc.ram", ranges);
    const size_t first = 5 + 3 + 6 + 12 * 16, second = 5 + 3 + 6 + 16;
    REQUIRE(out.size() == first + second);
    CHECK(out[0] == QEMU_VM_COMMAND);
    CHECK(get_be16(&out[1]) == MIG_CMD_POSTCOPY_RAM_DISCARD);
    CHECK(get_be16(&out[3]) == first - 5);
    CHECK(out[5] == 0); // version
    CHECK(out[6] == 6);
    CHECK(std::memcmp(&out[7], "pc.ram", 6) == 0);
    CHECK(out[13] == 0); // nil
    CHECK(get_be64(&out[14 + 16]) == 2 * TARGET_PAGE_SIZE);
    CHECK(get_be64(&out[first + 14]) == 24 * TARGET_PAGE_SIZE);
    out.clear();
    savevm_put_postcopy_ram_discard(w, "mem", {});
    CHECK(out.empty());
}

TEST_CASE("ADVISE and PACKAGED as QEMU lays them out", "[postcopy]")
{
    std::vector<uint8_t> out;
    ByteWriter w(out);
    savevm_put_postcopy_advise(w, 0x201000);
    CHECK(out == std::vector<uint8_t>{8, 0, 3, 0, 16, 0, 0, 0, 0, 0, 0x20, 0x10, 0,
                                      0, 0, 0, 0, 0, 0, 0x10, 0});
    out.clear();
    savevm_put_packaged(w, std::vector<uint8_t>{1, 2, 3});
    CHECK(out == std::vector<uint8_t>{8, 0, 7, 0, 4, 0, 0, 0, 3, 1, 2, 3});
}

TEST_CASE("a postcopy stream loads: device state from the package, RAM after it", "[postcopy]")
{
    PostcopyRam ram;
    auto r = load(postcopy_stream(), ram, postcopy_config());
    REQUIRE(r.ok());
    CHECK(r->postcopy);
    CHECK(r->runstate == "running");
    CHECK(ram.listening);
    CHECK(ram.pongs == std::vector<uint32_t>{1, 2, 3, 4});
    CHECK(ram.discards == DiscardRanges{{TARGET_PAGE_SIZE, 2 * TARGET_PAGE_SIZE}});
    CHECK(ram.ram[TARGET_PAGE_SIZE] == 0x22);
    CHECK(ram.ram[2 * TARGET_PAGE_SIZE] == 0);
    CHECK(ram.ram[0] == 0xAA);
}

TEST_CASE("parking keeps a postcopy package's device sections", "[postcopy][park]")
{
    PostcopyRam ram;
    auto r = load(postcopy_stream(), ram, postcopy_config(true));
    REQUIRE(r.ok());
    CHECK(ram.announcements > 0);
    CHECK(ram.pongs == std::vector<uint32_t>{1, 2, 3, 4});
    auto info = device_state_check(r->device_state);
    REQUIRE(info.ok());
    auto pkg = postcopy_package();
    std::vector<uint8_t> sections(pkg.begin() + 5, pkg.end() - 5 - 9);
    REQUIRE(info->sections_bytes == sections.size());
    CHECK(std::equal(sections.begin(), sections.end(), r->device_state.begin()));

    SECTION("a package that is not LISTEN, sections, RUN")
    {
        auto bad = pkg;
        bad[2] = MIG_CMD_POSTCOPY_RUN;
        CHECK(load_error(postcopy_stream(bad), postcopy_config(true)).find(
                  "its postcopy package is not POSTCOPY_LISTEN") != std::string::npos);
        bad = pkg;
        bad.insert(bad.begin() + 5, {QEMU_VM_COMMAND, 0, 2, 0, 4, 0, 0, 0, 9});
        CHECK(load_error(postcopy_stream(bad), postcopy_config(true)).find(
                  "holds more than device sections") != std::string::npos);
    }
}

TEST_CASE("postcopy commands out of place or malformed fail in QEMU's words", "[postcopy]")
{
    auto s = postcopy_stream();
    size_t advise = find(s, {QEMU_VM_COMMAND, 0, MIG_CMD_POSTCOPY_ADVISE, 0, 16});
    size_t discard = find(s, {QEMU_VM_COMMAND, 0, MIG_CMD_POSTCOPY_RAM_DISCARD});
    size_t discard_len = 5 + get_be16(&s[discard + 3]);
    LoadvmConfig plain = postcopy_config();
    plain.postcopy_ram = false;

    CHECK(load_error(s, plain) == "RAM postcopy is disabled but have 16 byte advise");
    CHECK(load_error(replace_at(s, advise, kAdviseSize, command(MIG_CMD_POSTCOPY_ADVISE, {}))) ==
          "RAM postcopy is enabled but have 0 byte advise");
    CHECK(load_error(replace_at(s, advise, kAdviseSize,
                                command(MIG_CMD_POSTCOPY_ADVISE, std::vector<uint8_t>(8)))) ==
          "CMD_POSTCOPY_ADVISE invalid length (8)");
    {
        auto twice = s;
        twice.insert(twice.begin() + long(advise), s.begin() + long(advise),
                     s.begin() + long(advise + kAdviseSize));
        CHECK(load_error(twice) == "CMD_POSTCOPY_ADVISE in wrong postcopy state (1)");
    }
    {
        auto huge = s;
        huge[advise + 5 + 5] = 0x20; // 0x201000
        CHECK(load_error(huge) == "Postcopy needs matching RAM page sizes (s=201000 d=1000)");
        auto tps = s;
        tps[advise + 5 + 8 + 6] = 0x20;
        CHECK(load_error(tps) == "Postcopy needs matching target page sizes (s=8192 d=4096)");
    }
    {
        auto no_advise = s;
        no_advise.erase(no_advise.begin() + long(advise),
                        no_advise.begin() + long(advise + kAdviseSize));
        CHECK(load_error(no_advise) == "CMD_POSTCOPY_RAM_DISCARD in wrong postcopy state (0)");
    }
    auto discard_with = [&](std::string_view id, uint8_t version, uint8_t nil,
                            std::vector<std::pair<uint64_t, uint64_t>> ranges, int extra = 0) {
        std::vector<uint8_t> p;
        ByteWriter w(p);
        w.u8(version);
        w.cstr8(id);
        w.u8(nil);
        for (auto [a, b] : ranges) {
            w.be64(a);
            w.be64(b);
        }
        p.insert(p.end(), size_t(extra), 0);
        return replace_at(s, discard, discard_len, command(MIG_CMD_POSTCOPY_RAM_DISCARD, p));
    };
    CHECK(load_error(discard_with("mem", 1, 0, {{0, 4096}})) ==
          "CMD_POSTCOPY_RAM_DISCARD invalid version (1)");
    CHECK(load_error(discard_with("mem", 0, 7, {{0, 4096}})) ==
          "CMD_POSTCOPY_RAM_DISCARD missing nil (7)");
    CHECK(load_error(discard_with("mem", 0, 0, {{0, 4096}}, 3)) ==
          "CMD_POSTCOPY_RAM_DISCARD invalid length (19)");
    CHECK(load_error(discard_with("mem", 0, 0, {})) ==
          "CMD_POSTCOPY_RAM_DISCARD invalid length (6)");
    CHECK(load_error(discard_with("nope", 0, 0, {{0, 4096}})) ==
          "ram_discard_range: Failed to find block 'nope'");
    CHECK(load_error(discard_with("mem", 0, 0, {{100, 4096}})) ==
          "ram_block_discard_range: Unaligned start address: 0x64");
    CHECK(load_error(discard_with("mem", 0, 0, {{kBlockSize - 4096, 8192}})) ==
          "ram_block_discard_range: Overrun block 'mem' (61440/2000/10000)");
    CHECK(load_error(discard_with("mem", 0, 0, {{4096, ~uint64_t(0) - 100}})) ==
          "ram_block_discard_range: Overrun block 'mem' (4096/ffffffffffffff9b/10000)");
    CHECK(load_error(discard_with("mem", 0, 0, {{4096, 100}})) ==
          "ram_block_discard_range: Unaligned length: 64");
}

TEST_CASE("packages that are too big, cut, nested or never RUN are refused", "[postcopy]")
{
    auto pkg = postcopy_package();
    {
        auto s = postcopy_stream();
        size_t at = find(s, {QEMU_VM_COMMAND, 0, MIG_CMD_PACKAGED, 0, 4});
        put_be32(&s[at + 5], uint32_t(kMaxDeviceState) + 1);
        CHECK(load_error(s) == "Unreasonably large packaged state: 67108865");
        s.resize(at + 9 + 10);
        put_be32(&s[at + 5], uint32_t(pkg.size()));
        CHECK(load_error(s).find("CMD_PACKAGED: Buffer receive fail: ") == 0);
    }
    CHECK(load_error(postcopy_stream({})) ==
          "CMD_PACKAGED: the package ended before POSTCOPY_RUN"); // an empty one
    auto no_run = pkg;
    no_run.resize(pkg.size() - 5);
    CHECK(load_error(postcopy_stream(no_run)) ==
          "CMD_PACKAGED: the package ended before POSTCOPY_RUN");
    std::vector<uint8_t> nested;
    ByteWriter w(nested);
    savevm_put_command(w, MIG_CMD_POSTCOPY_LISTEN);
    savevm_put_packaged(w, pkg);
    CHECK(load_error(postcopy_stream(nested)) == "CMD_PACKAGED inside a package");
    std::vector<uint8_t> run_first;
    ByteWriter r(run_first);
    savevm_put_command(r, MIG_CMD_POSTCOPY_RUN);
    CHECK(load_error(postcopy_stream(run_first)) == "CMD_POSTCOPY_RUN in wrong postcopy state (2)");
    std::vector<uint8_t> part;
    ByteWriter p(part);
    savevm_put_command(p, MIG_CMD_POSTCOPY_LISTEN);
    savevm_put_section_continue(p, QEMU_VM_SECTION_PART, 1);
    CHECK(load_error(postcopy_stream(part)) == "Unexpected section type 2 in a postcopy package");
    std::vector<uint8_t> listen_twice = pkg;
    listen_twice.insert(listen_twice.begin(), pkg.begin(), pkg.begin() + 5);
    CHECK(load_error(postcopy_stream(listen_twice)) ==
          "CMD_POSTCOPY_LISTEN in wrong postcopy state (3)");
}

TEST_CASE("page requests are checked in QEMU's words and queued in order", "[postcopy]")
{
    PageRequests q({{"pc.ram", 1 << 20}, {"vga.vram", 1 << 16}});
    std::string ram = "pc.ram", vga = "vga.vram", nope = "nope";
    CHECK(q.push(nullptr, 0, 4096).error().message() ==
          "MIG_RP_MSG_REQ_PAGES has no previous block");
    CHECK(q.push(&ram, 100, 4096).error().message() ==
          "MIG_RP_MSG_REQ_PAGES: Misaligned page request, start:64 len: 4096");
    CHECK(q.push(&nope, 0, 4096).error().message() == "MIG_RP_MSG_REQ_PAGES has no block 'nope'");
    CHECK(q.push(&vga, 0xf000, 0x2000).error().message() ==
          "MIG_RP_MSG_REQ_PAGES request overrun, start=f000 len=2000 blocklen=10000");
    CHECK(q.push(&vga, ~uint64_t(0) - 4095, 0x2000).error().message() ==
          "MIG_RP_MSG_REQ_PAGES request overrun, start=fffffffffffff000 len=2000 "
          "blocklen=10000");
    CHECK(q.push(&vga, 0, 0).error().message() ==
          "MIG_RP_MSG_REQ_PAGES request overrun, start=0 len=0 blocklen=10000");
    CHECK_FALSE(q.pending());
    REQUIRE(q.push(&ram, 0x1000, 0x3000).ok());
    REQUIRE(q.push(nullptr, 0xff000, 0x1000).ok()); // the previous block
    REQUIRE(q.push(&vga, 0x1000, 0).ok());          // a page, as QEMU serves it
    CHECK(q.count() == 9);
    auto a = q.pop(), b = q.pop(), c = q.pop();
    REQUIRE((a && b && c));
    CHECK((a->block == 0 && a->offset == 0x1000 && a->len == 0x3000));
    CHECK((b->block == 0 && b->offset == 0xff000 && b->len == 0x1000));
    CHECK((c->block == 1 && c->offset == 0x1000 && c->len == 0x1000));
    CHECK_FALSE(q.pop());
    for (size_t i = 0; i < PageRequests::kMaxQueued; i++) {
        REQUIRE(q.push(&ram, 0, 4096).ok());
    }
    CHECK(q.push(&ram, 0, 4096).error().message() ==
          "return path: more than 65536 page requests pending");
}

TEST_CASE("a received bitmap travels as QEMU sends it and is read back", "[postcopy][recovery]")
{
    const uint64_t pages = 130; // three words, the last one partial
    ReceivedBitmap r(pages);
    r.set(0, 70);
    r.clear(3, 2);
    r.set(129, 5); // clipped at the block's end
    auto bits = r.snapshot();
    REQUIRE(bits.size() == 3);
    CHECK(bits[0] == (~uint64_t(0) & ~(uint64_t(3) << 3)));
    CHECK(bits[1] == 0x3f);
    CHECK(bits[2] == 2);
    std::vector<uint8_t> wire;
    rp_put_recv_bitmap_data(wire, bits, pages);
    REQUIRE(wire.size() == 8 + 24 + 8);
    CHECK(get_be64(wire.data()) == 24);
    CHECK(get_le64(wire.data() + 8 + 8) == 0x3f);
    CHECK(get_be64(wire.data() + 32) == RAMBLOCK_RECV_BITMAP_ENDING);

    PostcopyRecovery rec({{"mem", pages * TARGET_PAGE_SIZE}});
    size_t at = 0;
    auto reader = [&](const std::vector<uint8_t> &bytes) {
        at = 0;
        return [&, bytes](uint8_t *p, size_t n) -> Status {
            if (at + n > bytes.size()) {
                return Error("cut short");
            }
            std::memcpy(p, bytes.data() + at, n);
            at += n;
            return {};
        };
    };
    CHECK(rec.recv_bitmap("mem", reader(wire)).error().message() ==
          "Reload bitmap in incorrect state postcopy-active");
    rec.begin();
    CHECK(rec.recv_bitmap("nope", reader(wire)).error().message() ==
          "MIG_RP_MSG_RECV_BITMAP has invalid block name 'nope'");
    auto bad = wire;
    put_be64(bad.data(), 16);
    CHECK(rec.recv_bitmap("mem", reader(bad)).error().message() ==
          "ramblock 'mem' bitmap size mismatch (0x10 != 0x18)");
    bad = wire;
    bad.back() ^= 1;
    CHECK(rec.recv_bitmap("mem", reader(bad)).error().message() ==
          "ramblock 'mem' end mark incorrect: 0x123456789abcdee");
    bad = wire;
    put_le64(bad.data() + 8 + 16, ~uint64_t(0)); // bits past the end are dropped
    REQUIRE(rec.recv_bitmap("mem", reader(bad)).ok());
    CHECK(rec.received(0)[2] == 3);
    CHECK(rec.resume_ack(2).error().message() == "illegal resume_ack value 2");
    REQUIRE(rec.resume_ack(1).ok());
    CHECK(rec.resume_ack(1).ok()); // a duplicate is dropped, as QEMU 10 drops it
    CHECK(rec.resume_ack(2).error().message() == "illegal resume_ack value 2");
}

TEST_CASE("a resume's waits end when the return path ends cleanly", "[postcopy][recovery]")
{
    for (bool bitmaps_first : {false, true}) {
        int sv[2];
        REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
        PostcopyRecovery rec({{"mem", kBlockSize}});
        rec.begin();
        Channel ch{UniqueFd(sv[0])}; // outlives the reader
        ReturnPathIn rp(ch, nullptr, &rec);
        std::vector<uint8_t> msg;
        if (bitmaps_first) {
            std::vector<uint64_t> bits(1, 1);
            rp_put_recv_bitmap(msg, "mem");
            rp_put_recv_bitmap_data(msg, bits, kPages);
        }
        rp_put_shut(msg, 0); // the reader ends without an error
        REQUIRE(::write(sv[1], msg.data(), msg.size()) == ssize_t(msg.size()));
        if (bitmaps_first) {
            REQUIRE(rec.wait_bitmaps(rp).ok());
            CHECK(rec.wait_ack(rp).error().message() ==
                  "the return path ended before the destination sent RESUME_ACK");
        } else {
            CHECK(rec.wait_bitmaps(rp).error().message() ==
                  "the return path ended before the destination sent its received bitmaps");
        }
        CHECK(rp.wait().ok());
        ::close(sv[1]);
    }
}

TEST_CASE("a return-path write to a source that never reads ends on abort", "[postcopy]")
{
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    PeerWriteGuard guard;
    Channel ch{UniqueFd(sv[0])};
    auto out = ReturnPathOut::open(ch, guard);
    REQUIRE(out.ok());
    std::atomic<pid_t> tid{0};
    Status st;
    std::thread writer([&] {
        tid = testing::this_tid();
        while ((st = (*out)->pong(1)).ok()) {
        }
    });
    // The socket full, the writer asleep in send().
    REQUIRE(testing::wait_blocked(tid));
    guard.abort();
    writer.join();
    CHECK_FALSE(st.ok());
    // The verdict after it is abandoned, not blocked on the full socket
    // (which would hang here: the bound is only generous, not a latency).
    auto t0 = std::chrono::steady_clock::now();
    (*out)->shut(true);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
    ::close(sv[1]); // sv[0] is the channel's
}

TEST_CASE("the preempt channel ends at its EOS, as QEMU's preempt thread does", "[postcopy]")
{
    std::vector<uint8_t> bytes;
    ByteWriter w(bytes);
    RamRecordEncoder rec;
    put_page(w, rec, 3, 0x33);
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    w.bytes(std::vector<uint8_t>(8, 0xff).data(), 8); // never read
    PostcopyRam ram;
    MemoryInputStream in(bytes.data(), bytes.size());
    QEMUFileReader f(in, 64);
    auto r = qemu_load_preempt_channel(f, postcopy_config(), ram);
    REQUIRE(r.ok());
    CHECK(r->normal_pages == 1);
    CHECK(ram.ram[3 * TARGET_PAGE_SIZE] == 0x33);
    // Cut after a record, with no EOS: the channel broke.
    bytes.resize(bytes.size() - 16);
    MemoryInputStream cut(bytes.data(), bytes.size());
    QEMUFileReader g(cut, 64);
    CHECK_FALSE(qemu_load_preempt_channel(g, postcopy_config(), ram).ok());
}

TEST_CASE("a resumed stream: RECV_BITMAP and POSTCOPY_RESUME, in QEMU's words", "[postcopy][recovery]")
{
    struct Recovering : PostcopyRam {
        std::vector<size_t> asked;
        int resumed = 0;
        Status send_recv_bitmap(size_t block) override
        {
            asked.push_back(block);
            return {};
        }
        Status postcopy_resume() override
        {
            resumed++;
            return {};
        }
    };
    // The stream up to the package, cut there: the loader is in postcopy.
    auto first = postcopy_head();
    auto rest = postcopy_tail(true);

    Recovering ram;
    LoadvmSession session(postcopy_config(), ram);
    MemoryInputStream in1(first.data(), first.size());
    QEMUFileReader f1(in1, 64);
    auto r1 = session.load(f1);
    REQUIRE_FALSE(r1.ok());
    INFO(r1.error().message());
    REQUIRE(session.in_postcopy());
    MemoryInputStream in2(rest.data(), rest.size());
    QEMUFileReader f2(in2, 64);
    auto r = session.resume(f2);
    REQUIRE(r.ok());
    CHECK(ram.asked == std::vector<size_t>{0});
    CHECK(ram.resumed == 1);
    CHECK(ram.ram[TARGET_PAGE_SIZE] == 0x22);

    auto resumed_error = [&](const std::vector<uint8_t> &bytes) {
        Recovering other;
        LoadvmSession sess(postcopy_config(), other);
        MemoryInputStream a(first.data(), first.size());
        QEMUFileReader fa(a, 64);
        REQUIRE_FALSE(sess.load(fa).ok());
        MemoryInputStream b(bytes.data(), bytes.size());
        QEMUFileReader fb(b, 64);
        auto res = sess.resume(fb);
        REQUIRE_FALSE(res.ok());
        return res.error().message();
    };
    CHECK(resumed_error(command(MIG_CMD_RECV_BITMAP, {3, 'n', 'o', 'p'})) ==
          "loadvm_handle_recv_bitmap: block 'nop' not found");
    CHECK(resumed_error(command(MIG_CMD_RECV_BITMAP, {3, 'm', 'e', 'm', 0})) ==
          "loadvm_handle_recv_bitmap: invalid payload length (5)");
    // Outside a recovery RECV_BITMAP is refused, POSTCOPY_RESUME ignored.
    auto early = postcopy_stream();
    size_t at = find(early, {QEMU_VM_SECTION_START, 0, 0, 0, 1});
    auto cmd = command(MIG_CMD_RECV_BITMAP, {3, 'm', 'e', 'm'});
    early.insert(early.begin() + long(at), cmd.begin(), cmd.end());
    CHECK(load_error(early) == "MSG_RP_RECV_BITMAP only used for recovery");
    auto ignored = postcopy_stream();
    cmd = command(MIG_CMD_POSTCOPY_RESUME, {});
    ignored.insert(ignored.begin() + long(at), cmd.begin(), cmd.end());
    PostcopyRam plain;
    CHECK(load(ignored, plain, postcopy_config()).ok());
}
