// A parked VM's working set record (daemon/park/working_set.h): encoded,
// decoded, and every bad file refused whole.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "daemon/park/working_set.h"
#include "protocol/qemu_format.h"

using namespace qmigd;

namespace {

const std::vector<ParkedBlock> kWsBlocks = {{"pc.ram", 1 << 20}, {"pc.bios", 256 << 10}};

std::vector<WorkingSetRange> ws_sample()
{
    return {{0, 5 * TARGET_PAGE_SIZE, 3}, {1, 0, 1}, {0, 0, 1}, {1, (256 << 10) - 4096, 1}};
}

std::string ws_refusal(const std::vector<uint8_t> &bytes)
{
    auto r = working_set_decode(bytes, kWsBlocks);
    REQUIRE_FALSE(r.ok());
    return r.error().message();
}

std::string ws_refusal_with(const std::vector<ParkedBlock> &blocks,
                            const std::vector<WorkingSetRange> &ranges)
{
    auto r = working_set_decode(working_set_encode(blocks, ranges), blocks);
    REQUIRE_FALSE(r.ok());
    return r.error().message();
}

void ws_put_be(std::vector<uint8_t> &b, size_t at, uint64_t v, int bytes)
{
    for (int i = bytes - 1; i >= 0; i--) {
        b[at + size_t(bytes - 1 - i)] = uint8_t(v >> (8 * i));
    }
}

// Where the range count is in ws_sample()'s encoding.
size_t ws_ranges_at()
{
    size_t at = 8 + 4 + 4;
    for (const auto &b : kWsBlocks) {
        at += 1 + b.idstr.size() + 8;
    }
    return at;
}

} // namespace

TEST_CASE("a working set reads back as it was written, in its order", "[park][working-set]")
{
    auto bytes = working_set_encode(kWsBlocks, ws_sample());
    auto back = working_set_decode(bytes, kWsBlocks);
    REQUIRE(back.ok());
    REQUIRE(back->size() == 4);
    for (size_t i = 0; i < back->size(); i++) {
        CHECK((*back)[i].block == ws_sample()[i].block);
        CHECK((*back)[i].offset == ws_sample()[i].offset);
        CHECK((*back)[i].pages == ws_sample()[i].pages);
    }
    CHECK(working_set_pages(*back) == 6);
    // Blocks by name: a VM listing them in another order reads the same pages.
    std::vector<ParkedBlock> swapped = {kWsBlocks[1], kWsBlocks[0]};
    auto other = working_set_decode(bytes, swapped);
    REQUIRE(other.ok());
    CHECK((*other)[0].block == 1);
    CHECK((*other)[1].block == 0);
    // No range at all is a working set too.
    auto empty = working_set_decode(working_set_encode(kWsBlocks, {}), kWsBlocks);
    REQUIRE(empty.ok());
    CHECK(empty->empty());
}

TEST_CASE("a bad working set file is refused whole", "[park][working-set]")
{
    auto good = working_set_encode(kWsBlocks, ws_sample());
    // Truncated anywhere, or with bytes after its end.
    for (size_t n = 0; n < good.size(); n++) {
        std::vector<uint8_t> cut(good.begin(), good.begin() + long(n));
        INFO("cut at " << n);
        ws_refusal(cut);
    }
    auto longer = good;
    longer.push_back(0);
    CHECK_THAT(ws_refusal(longer), Catch::Contains("ranges in"));
    auto magic = good;
    magic[0] = 'X';
    CHECK_THAT(ws_refusal(magic), Catch::Contains("not a working set file"));
    auto version = good;
    version[11] = 2;
    CHECK_THAT(ws_refusal(version), Catch::Contains("version 2"));
    // A block the VM does not have, or of another size.
    CHECK_THAT(ws_refusal(working_set_encode({{"pc.rom", 1 << 20}}, {})),
               Catch::Contains("no block 'pc.rom'"));
    CHECK_THAT(ws_refusal(working_set_encode({{"pc.ram", 2 << 20}}, {})),
               Catch::Contains("is 1048576 bytes"));
    // Offsets past the block, misaligned, a range running over its end,
    // an index past the block list, no pages.
    const std::vector<ParkedBlock> bigger = {{"pc.ram", 1 << 30}, {"pc.bios", 256 << 10}};
    auto past = working_set_encode(bigger, {{0, 1 << 20, 1}});
    ws_put_be(past, 8 + 4 + 4 + 1 + 6, 1 << 20, 8); // the sizes the VM has
    CHECK_THAT(ws_refusal(past), Catch::Contains("not inside block 'pc.ram'"));
    for (auto bad : std::vector<WorkingSetRange>{{0, 100, 1},
                                                 {0, (1 << 20) - 4096, 2},
                                                 {0, 0, 0},
                                                 {0, uint64_t(-4096), 2}}) {
        auto b = working_set_encode(kWsBlocks, {bad});
        CHECK_THAT(ws_refusal(b), Catch::Contains("not inside block"));
    }
    auto index = working_set_encode(kWsBlocks, {{7, 0, 1}});
    CHECK_THAT(ws_refusal(index), Catch::Contains("names block 7 of 2"));
    // Huge counts: of ranges (checked against the bytes left, nothing
    // allocated for them) and of blocks.
    auto count = good;
    ws_put_be(count, ws_ranges_at(), 0xffffffff, 4);
    CHECK_THAT(ws_refusal(count), Catch::Contains("4294967295 ranges"));
    auto blocks = good;
    ws_put_be(blocks, 12, 100000, 4);
    CHECK_THAT(ws_refusal(blocks), Catch::Contains("100000 blocks"));
}

TEST_CASE("a working set of more pages than the format holds is refused",
          "[park][working-set]")
{
    const std::vector<ParkedBlock> huge = {{"pc.ram", uint64_t(64) << 30}};
    std::vector<WorkingSetRange> ranges;
    for (uint64_t i = 0; i < 3; i++) {
        ranges.push_back({0, i * (uint64_t(8) << 30), kWorkingSetMaxPages / 2});
    }
    CHECK_THAT(ws_refusal_with(huge, ranges), Catch::Contains("more than"));
}

TEST_CASE("a working set file is written durably and read back as input",
          "[park][working-set]")
{
    namespace fs = std::filesystem;
    fs::path dir = fs::temp_directory_path() / fmt::format("qmigd-ws-{}", ::getpid());
    fs::remove_all(dir);
    fs::create_directory(dir);
    ParkedVm vm;
    vm.dir = dir.string();
    vm.blocks = kWsBlocks;
    auto none = working_set_read(vm);
    REQUIRE(none.ok());
    CHECK(none->empty());
    REQUIRE(working_set_write(vm, ws_sample()).ok());
    auto back = working_set_read(vm);
    REQUIRE(back.ok());
    CHECK(working_set_pages(*back) == 6);
    // Only the file itself is left: no temporary name behind it.
    CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}) == 1);
    // Something else in its place is refused, not followed or waited on.
    fs::remove(working_set_path(vm.dir));
    fs::create_symlink("/dev/zero", working_set_path(vm.dir));
    CHECK_THAT(working_set_read(vm).error().message(), Catch::Contains("symbolic link"));
    fs::remove(working_set_path(vm.dir));
    REQUIRE(::mkfifo(working_set_path(vm.dir).c_str(), 0600) == 0);
    CHECK_THAT(working_set_read(vm).error().message(), Catch::Contains("not a regular file"));
    fs::remove_all(dir);
}
