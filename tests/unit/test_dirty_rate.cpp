// calc-dirty-rate's pieces: QEMU's page hash, the dirty bitmap's second
// collector, the rates, HMP's expressions and text; the listed threads.
#include <catch2/catch.hpp>

#include <dlfcn.h>
#include <thread>
#include <unistd.h>

#include "daemon/migration_threads.h"
#include "monitor/hmp_dirty_rate.h"
#include "protocol/qemu_format.h"
#include "ramstate/dirty_bitmap.h"
#include "ramstate/dirty_rate.h"

using namespace qmigd;

namespace {

// xxHash's own XXH64, from the library when the machine has it.
using Xxh64 = unsigned long long (*)(const void *, size_t, unsigned long long);
Xxh64 reference_xxh64()
{
    void *lib = dlopen("libxxhash.so.0", RTLD_NOW);
    return lib ? reinterpret_cast<Xxh64>(dlsym(lib, "XXH64")) : nullptr;
}

} // namespace

TEST_CASE("dirty rate: page hash is XXH64 with seed 1, cut to 32 bits", "[dirty_rate]")
{
    alignas(64) uint8_t page[TARGET_PAGE_SIZE] = {};
    uint32_t zero = dirty_rate_page_hash(page);
    page[4095] = 1;
    CHECK(dirty_rate_page_hash(page) != zero);
    Xxh64 ref = reference_xxh64();
    if (!ref) {
        WARN("libxxhash.so.0 not found: hash not compared with xxHash's");
        return;
    }
    for (uint32_t seed = 0; seed < 64; seed++) {
        for (size_t i = 0; i < sizeof(page); i++) {
            page[i] = uint8_t((i * 131 + seed * 7) ^ (i >> 5));
        }
        REQUIRE(dirty_rate_page_hash(page) == uint32_t(ref(page, sizeof(page), 1)));
    }
}

TEST_CASE("dirty rate: QEMU's sample counts and rates", "[dirty_rate]")
{
    CHECK(dirty_rate_samples(1ull << 30, 512) == 512);
    CHECK(dirty_rate_samples(256ull << 20, 512) == 128);
    CHECK(dirty_rate_samples(1ull << 20, 512) == 0);
    // 25600 pages (100 MiB) in 1000 ms: 100 MB/s; in 2000 ms: 50.
    CHECK(dirty_rate_from_pages(25600, 1000) == 100);
    CHECK(dirty_rate_from_pages(25600, 2000) == 50);
    CHECK(dirty_rate_from_pages(100, 0) == 0);
    // 10% of samples dirty over 1024 MiB in 1 s: 102 MB/s.
    CHECK(dirty_rate_from_samples(51, 512, 1024, 1000) == 102);
    CHECK(dirty_rate_from_samples(0, 0, 1024, 1000) == 0);
}

TEST_CASE("dirty bitmap: calc-dirty-rate's sync leaves every page to the migration",
          "[dirty_rate]")
{
    std::string path = "/dev/shm/qmigd-unit-rate-" + std::to_string(getpid());
    auto bm = DirtyBitmap::open(path, 200);
    ::unlink(path.c_str());
    REQUIRE(bm.ok());
    DirtyBitmap &b = **bm;
    b.set_dirty(3);
    b.set_dirty(150);
    REQUIRE(b.sync_to_pending());
    CHECK(b.collected() == 2);
    b.set_dirty(3); // again after the rate's sync: counted again
    b.set_dirty(70);
    REQUIRE(b.sync_to_pending());
    CHECK(b.collected() == 4);
    std::vector<uint64_t> dest(b.words(), 0);
    std::vector<size_t> words_seen;
    CHECK(b.sync_and_clear(dest, [&](size_t w, uint64_t) { words_seen.push_back(w); }) == 3);
    CHECK(dest[0] == (uint64_t(1) << 3));
    CHECK(dest[1] == (uint64_t(1) << 6));
    CHECK(dest[2] == (uint64_t(1) << 22));
    CHECK(words_seen == std::vector<size_t>{0, 1, 2});
    CHECK(b.collected() == 4); // pending pages were counted when taken
    CHECK(b.sync_and_clear(dest) == 0);
    b.set_dirty(5);
    CHECK(b.sync_and_clear(dest) == 1);
    CHECK(b.collected() == 5);
}

TEST_CASE("HMP: expressions as QEMU's monitor reads them", "[dirty_rate]")
{
    auto eval = [](const char *text, int64_t *v) {
        const char *p = text;
        return hmp_parse_expr(p, v);
    };
    int64_t v = 0;
    CHECK_FALSE(eval("1+1", &v));
    CHECK(v == 2);
    CHECK_FALSE(eval("0x10 * (2 + 1)", &v));
    CHECK(v == 48);
    CHECK_FALSE(eval("-5 % 3", &v));
    CHECK(v == -2);
    CHECK(*eval("", &v) == "unexpected end of expression");
    CHECK(*eval("x", &v) == "invalid char 'x' in expression");
    CHECK(*eval("-r", &v) == "invalid char 'r' in expression");
    CHECK(*eval("4/0", &v) == "division by zero");
    CHECK(*eval("99999999999999999999", &v) == "number too large");
    const char *p = "2 256";
    CHECK_FALSE(hmp_parse_expr(p, &v));
    CHECK(std::string(p) == "256");
}

TEST_CASE("HMP: expressions QEMU's monitor dies of are errors or defined", "[dirty_rate]")
{
    auto eval = [](const std::string &text, int64_t *v) {
        const char *p = text.c_str();
        return hmp_parse_expr(p, v);
    };
    int64_t v = 0;
    // SIGFPE in QEMU 10: the quotient wraps as the other operators do.
    CHECK_FALSE(eval("-0x8000000000000000 / -1", &v));
    CHECK(v == INT64_MIN);
    CHECK_FALSE(eval("-0x8000000000000000 % -1", &v));
    CHECK(v == 0);
    CHECK_FALSE(eval("7 / -1", &v));
    CHECK(v == -7);
    // SIGSEGV in QEMU 10 (its stack): nesting is bounded.
    auto repeated = [](char c, size_t n, const std::string &then) {
        std::string s(n, c);
        s.append(then);
        return s;
    };
    CHECK(*eval(repeated('~', 100000, "1"), &v) == "expression nested too deeply");
    CHECK(*eval(repeated('(', 100000, "1"), &v) == "expression nested too deeply");
    CHECK_FALSE(eval(repeated('(', 1000, "1" + std::string(1000, ')')), &v));
    CHECK(v == 1);
    CHECK_FALSE(eval(repeated('-', 1001, "2"), &v));
    CHECK(v == -2);
}

TEST_CASE("HMP: info dirty_rate text", "[dirty_rate]")
{
    json measuring = {{"status", "measuring"}, {"sample-pages", 512}, {"mode", "page-sampling"},
                      {"calc-time-unit", "second"}, {"start-time", 1796208027}, {"calc-time", 1}};
    CHECK(hmp_format_info_dirty_rate(measuring) ==
          "Status: measuring\r\nStart Time: 1796208027 (ms)\r\nSample Pages: 512 (per GB)\r\n"
          "Period: 1 (sec)\r\nMode: page-sampling\r\nDirty rate: (not ready)\r\n");
    json bitmap = {{"status", "measured"}, {"sample-pages", 0}, {"dirty-rate", 42},
                   {"mode", "dirty-bitmap"}, {"start-time", 5}, {"calc-time", 0}};
    CHECK(hmp_format_info_dirty_rate(bitmap) == "Status: measured\r\nStart Time: 5 (ms)\r\n"
                                                "Period: 0 (sec)\r\nMode: dirty-bitmap\r\n"
                                                "Dirty rate: 42 (MB/s)\r\n");
}

TEST_CASE("migration threads: listed with their thread ids while they run, newest first",
          "[dirty_rate]")
{
    CHECK(migration_threads().empty());
    {
        ListedMigrationThread main_thread("mig/src/main");
        std::vector<MigrationThreadInfo> seen;
        int sender_tid = 0;
        std::thread sender([&] { // Catch2 checks stay on the test's thread
            ListedMigrationThread listed("mig/src/send_0");
            seen = migration_threads();
            sender_tid = int(gettid());
        });
        sender.join();
        REQUIRE(seen.size() == 2);
        CHECK(seen[0].name == "mig/src/send_0");
        CHECK(seen[0].thread_id == sender_tid);
        CHECK(seen[1].name == "mig/src/main");
        auto t = migration_threads();
        REQUIRE(t.size() == 1);
        CHECK(t[0].thread_id == int(gettid()));
    }
    CHECK(migration_threads().empty());
}
