// mapped-ram: the per-block header and layout, and the loader's handling
// of a mapped-ram stream (capabilities, header, resuming after the pages).
#include <catch2/catch.hpp>

#include "tests/unit/fake_loader.h"
#include "protocol/loadvm.h"
#include "protocol/mapped_ram.h"
#include "protocol/savevm.h"

using namespace qmigd;

namespace {

constexpr uint64_t kBlock = 64 * TARGET_PAGE_SIZE;

// Records the headers it is given; stands in for the file reader.
// Only mapped-ram's headers: a page or a flush on the stream is an error.
struct FileRam : FakeLoader {
    std::vector<MappedRamHeader> headers;
    std::string refuse; // non-empty: fail with this
    Status put_page(size_t, uint64_t, const uint8_t *) override { return Error("no pages here"); }
    Status zero_page(size_t, uint64_t) override { return Error("no zero pages here"); }
    Status multifd_flush() override { return Error("no flush here"); }
    Status mapped_ram_block(size_t block, const MappedRamHeader &h) override
    {
        REQUIRE(block == 0);
        headers.push_back(h);
        return refuse.empty() ? Status() : Status(Error(refuse));
    }
};

// A mapped-ram file as qmigd's source lays it out: the stream up to the
// block's header, the pages region (zeros here), then the rest.
std::vector<uint8_t> mapped_file(bool with_cap = true)
{
    std::vector<uint8_t> out;
    ByteWriter w(out);
    RamBlockDesc mem{"mem", kBlock};
    static constexpr std::string_view caps[] = {"mapped-ram"};
    savevm_put_header(w);
    savevm_put_configuration(w, "none", nullptr,
                             with_cap ? std::span<const std::string_view>(caps)
                                      : std::span<const std::string_view>());
    savevm_put_section_header(w, QEMU_VM_SECTION_START, 1, "ram", 0, 4);
    ram_put_mem_size_word(w, std::span(&mem, 1));
    ram_put_block_entry(w, mem);
    MappedRamHeader h = mapped_ram_layout(out.size(), kBlock);
    mapped_ram_header_put(w, h);
    out.resize(h.pages_offset + kBlock, 0); // bitmap (all clear) and pages
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
    put_stream_end(w, "paused", false);
    return out;
}

Result<LoadvmResult> load(const std::vector<uint8_t> &bytes, FileRam &ram, bool mapped_ram = true)
{
    MemoryInputStream in(bytes.data(), bytes.size());
    QEMUFileReader f(in, 64);
    LoadvmConfig cfg;
    cfg.blocks = {{"mem", kBlock}};
    cfg.mapped_ram = mapped_ram;
    return qemu_loadvm_state(f, cfg, ram);
}

} // namespace

TEST_CASE("mapped-ram layout: bitmap after the header, pages on the next MiB", "[mapped-ram]")
{
    MappedRamHeader h = mapped_ram_layout(0x1234, 1ull << 30);
    CHECK(h.version == 1);
    CHECK(h.page_size == 4096);
    CHECK(h.bitmap_offset == 0x1234 + 28);
    CHECK(h.pages_offset == 0x100000); // 32 KiB of bitmap fits below 1 MiB
    CHECK(mapped_ram_bitmap_size(1) == 8);
    CHECK(mapped_ram_bitmap_size(64) == 8);
    CHECK(mapped_ram_bitmap_size(65) == 16);
    // A bitmap that crosses the boundary pushes the pages one MiB on.
    h = mapped_ram_layout(0x100000 - 28 - 8, 128 * TARGET_PAGE_SIZE);
    CHECK(h.pages_offset == 0x200000);
}

TEST_CASE("mapped-ram header: big-endian, 28 bytes, round trip", "[mapped-ram]")
{
    std::vector<uint8_t> out;
    ByteWriter w(out);
    MappedRamHeader h{1, 4096, 0x1122334455667788ull, 0x100000};
    mapped_ram_header_put(w, h);
    REQUIRE(out.size() == MAPPED_RAM_HEADER_SIZE);
    CHECK(out[3] == 1);
    CHECK(out[10] == 0x10); // page size 0x1000, big-endian
    CHECK(out[12] == 0x11);
    uint8_t raw[MAPPED_RAM_HEADER_SIZE];
    std::copy(out.begin(), out.end(), raw);
    MappedRamHeader back = mapped_ram_header_get(raw);
    CHECK(back.version == h.version);
    CHECK(back.page_size == h.page_size);
    CHECK(back.bitmap_offset == h.bitmap_offset);
    CHECK(back.pages_offset == h.pages_offset);
}

TEST_CASE("mapped-ram header checks against the file", "[mapped-ram]")
{
    const uint64_t file = 0x200000 + kBlock + 100;
    MappedRamHeader good{1, 4096, 0x100, 0x200000};
    CHECK(mapped_ram_header_check(good, "mem", kBlock, file));
    auto err = [&](MappedRamHeader h) {
        auto st = mapped_ram_header_check(h, "mem", kBlock, file);
        REQUIRE_FALSE(st);
        return st.error().message();
    };
    MappedRamHeader h = good;
    h.version = 2;
    CHECK(err(h) ==
          "Migration mapped-ram capability version not supported (expected <= 1, got 2)");
    h = good;
    h.page_size = 0;
    CHECK(err(h).find("page size 0x0") != std::string::npos);
    h = good;
    h.pages_offset += 8;
    CHECK(err(h) == "Error reading ramblock mem pages, region has bad alignment");
    h = good;
    h.bitmap_offset = file - 4;
    CHECK(err(h).find("bitmap of block mem") != std::string::npos);
    h = good;
    h.bitmap_offset = ~uint64_t(0); // no overflow
    CHECK(err(h).find("bitmap of block mem") != std::string::npos);
    h = good;
    h.pages_offset = good.pages_offset + TARGET_PAGE_SIZE; // the last page past the end
    CHECK(err(h).find("pages of block mem") != std::string::npos);
    h = good;
    h.pages_offset = ~uint64_t(4095);
    CHECK(err(h).find("pages of block mem") != std::string::npos);
}

TEST_CASE("a mapped-ram stream: header to the handler, stream resumes after the pages",
          "[mapped-ram][loadvm]")
{
    FileRam ram;
    auto file = mapped_file();
    auto r = load(file, ram);
    REQUIRE(r.ok());
    REQUIRE(ram.headers.size() == 1);
    CHECK(ram.headers[0].pages_offset % MAPPED_RAM_FILE_OFFSET_ALIGNMENT == 0);
    CHECK(r->runstate == "paused");
    CHECK(r->normal_pages == 0);
}

TEST_CASE("mapped-ram must be on at both ends", "[mapped-ram][loadvm]")
{
    FileRam ram;
    auto r = load(mapped_file(true), ram, false);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message() == "Capability mapped-ram is off, but received capability is on");
    r = load(mapped_file(false), ram, true);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message() == "Capability mapped-ram is on, but received capability is off");
}

TEST_CASE("a handler's refusal and a short file fail the load", "[mapped-ram][loadvm]")
{
    FileRam ram;
    ram.refuse = "bad header";
    auto r = load(mapped_file(), ram);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message() == "bad header");

    auto file = mapped_file();
    for (size_t cut : {size_t(30), size_t(60), file.size() - 40}) {
        std::vector<uint8_t> part(file.begin(), file.begin() + long(cut));
        FileRam fresh;
        CHECK_FALSE(load(part, fresh).ok());
    }
}
