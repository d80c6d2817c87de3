// XBZRLE encoding and decoding (protocol/xbzrle.h), the page cache
// (ramstate/page_cache.h), the source's choices (daemon/source/xbzrle_save.h) and
// the loader's XBZRLE records with their refusals in QEMU's words.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "daemon/source/xbzrle_save.h"
#include "protocol/xbzrle.h"
#include "ramstate/page_cache.h"

using namespace qmigd;

namespace {

using Page = std::vector<uint8_t>;

Page page_of(uint8_t fill = 0) { return Page(4096, fill); }

int encode(const Page &a, const Page &b, Page &out)
{
    out.assign(4096, 0xee);
    return xbzrle_encode(a.data(), b.data(), 4096, out.data(), out.size());
}

} // namespace

TEST_CASE("xbzrle: QEMU's layout, byte by byte", "[xbzrle]")
{
    Page a = page_of(), b = page_of(), out;
    CHECK(encode(a, b, out) == 0); // unchanged: nothing at all
    b[10] = 1, b[11] = 2, b[12] = 3;
    REQUIRE(encode(a, b, out) == 5); // zrun 10, nzrun 3, the bytes; no trailing zrun
    CHECK(Page(out.begin(), out.begin() + 5) == Page{10, 3, 1, 2, 3});
    b[300] = 9; // a zero run of 287: two ULEB128 bytes (0x9f 0x02)
    REQUIRE(encode(a, b, out) == 9);
    CHECK(Page(out.begin() + 5, out.begin() + 9) == Page{0x9f, 0x02, 1, 9});
    Page c = page_of();
    c[0] = 7; // a change at offset 0 starts with an empty zero run
    REQUIRE(encode(a, c, out) == 3);
    CHECK(Page(out.begin(), out.begin() + 3) == Page{0, 1, 7});
}

TEST_CASE("xbzrle: a page that changed all over does not fit", "[xbzrle]")
{
    Page a = page_of(), b = page_of(), out;
    for (size_t i = 0; i < 4096; i += 2) {
        b[i] = 1; // 2048 runs of one changed byte: 3 bytes each
    }
    CHECK(encode(a, b, out) == -1);
    Page whole = page_of(0x55); // one changed run of 4096: 4098 bytes
    CHECK(encode(a, whole, out) == -1);
}

TEST_CASE("xbzrle: random changes decode back to the new page", "[xbzrle]")
{
    std::mt19937_64 rng(7);
    for (int round = 0; round < 2000; round++) {
        Page a(4096), b;
        for (auto &x : a) {
            x = uint8_t(rng());
        }
        b = a;
        int changes = int(rng() % 64);
        for (int i = 0; i < changes; i++) {
            size_t at = rng() % 4096, len = 1 + rng() % 64;
            for (size_t j = at; j < std::min<size_t>(4096, at + len); j++) {
                b[j] = uint8_t(rng());
            }
        }
        Page out;
        int n = encode(a, b, out);
        if (n < 0) {
            continue; // too many changes: sent whole
        }
        Page c = a;
        REQUIRE(xbzrle_decode(out.data(), size_t(n), c.data(), 4096) >= 0);
        CHECK(c == b);
    }
}

TEST_CASE("xbzrle: malformed deltas are refused, nothing written outside", "[xbzrle]")
{
    struct Bad {
        Page delta;
        const char *why;
    };
    const Bad bad[] = {
        {{5}, "one byte: no room for a run"},
        {{0x80, 0x80, 1, 1}, "a length wider than 14 bits"},
        {{2, 0}, "an empty changed run"},
        {{0, 1, 5, 0, 1, 6}, "an empty zero run after the first"},
        {{0xff, 0x7f, 1, 1}, "a zero run past the page"},
        {{0x80, 0x20, 0x81, 0x00, 1}, "a changed run past the page"},
        {{0, 4, 1, 2}, "a changed run past the input"},
    };
    for (const auto &b : bad) {
        INFO(b.why);
        std::vector<uint8_t> guarded(4096 + 64, 0xaa);
        CHECK(xbzrle_decode(b.delta.data(), b.delta.size(), guarded.data() + 32, 4096) == -1);
        CHECK(std::all_of(guarded.begin(), guarded.begin() + 32, [](uint8_t x) { return x == 0xaa; }));
        CHECK(std::all_of(guarded.end() - 32, guarded.end(), [](uint8_t x) { return x == 0xaa; }));
    }
}

TEST_CASE("page cache: direct-mapped, a slot in use is kept for two syncs", "[xbzrle]")
{
    REQUIRE_FALSE(PageCache::create(3 * 4096, 4096)); // not a power of two of pages
    auto c = PageCache::create(4 * 4096, 4096);
    REQUIRE(c);
    PageCache &pc = **c;
    Page a = page_of(1), b = page_of(2);
    CHECK_FALSE(pc.lookup(0, 0));
    REQUIRE(pc.insert(0, a.data(), 0));
    CHECK(pc.lookup(0, 0));
    CHECK(std::memcmp(pc.data(0), a.data(), 4096) == 0);
    // Address 4 pages on shares slot 0: refused while page 0 is young.
    CHECK_FALSE(pc.insert(4 * 4096, b.data(), 1));
    CHECK(pc.insert(4 * 4096, b.data(), 2));
    CHECK_FALSE(pc.lookup(0, 2));
    CHECK(pc.lookup(4 * 4096, 2));
}

TEST_CASE("xbzrle source: miss, then delta, unchanged, overflow; last stage caches nothing",
          "[xbzrle]")
{
    auto cache = PageCache::create(16 * 4096, 4096);
    REQUIRE(cache);
    XbzrleSave x(std::move(*cache));
    CHECK_FALSE(x.started());
    x.start();
    Page p = page_of(3);
    const uint8_t *data = p.data();
    CHECK(x.save(0, &data) == XbzrleSave::Outcome::Whole); // a miss: cached, sent whole
    CHECK(data != p.data());                                 // from the cached copy
    data = p.data();
    CHECK(x.save(0, &data) == XbzrleSave::Outcome::Unchanged);
    p[100] = 4;
    data = p.data();
    REQUIRE(x.save(0, &data) == XbzrleSave::Outcome::Encoded);
    CHECK(x.encoded_len() == 3); // {100, 1, 4}: zrun 100 is one byte
    std::memset(p.data(), 0x77, 4096);
    data = p.data();
    CHECK(x.save(0, &data) == XbzrleSave::Outcome::Whole); // overflow
    CHECK(x.counters.overflow == 1);
    CHECK(x.counters.cache_miss == 1);
    CHECK(x.counters.pages == 3);
    x.set_last_stage();
    data = p.data();
    CHECK(x.save(8 * 4096, &data) == XbzrleSave::Outcome::Whole);
    CHECK(data == p.data()); // not cached
    x.stop();
    x.start();
    CHECK_FALSE(x.started()); // postcopy: never again
}
