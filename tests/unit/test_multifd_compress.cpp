// Compression streams: round trips across packets of one channel, the
// byte-level contract QEMU 10 relies on (flush per packet, never finish),
// and every way a broken or hostile payload must fail.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "protocol/multifd_compress.h"

using namespace qmigd;

namespace {

constexpr size_t kPage = TARGET_PAGE_SIZE;

// n pages: text-like, random, zero, each kind by turns.
std::vector<uint8_t> make_pages(uint32_t n, unsigned seed)
{
    std::vector<uint8_t> v(n * kPage);
    std::mt19937 rng(seed);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *p = v.data() + i * kPage;
        switch (i % 3) {
        case 0:
            for (size_t k = 0; k < kPage; k++) {
                p[k] = uint8_t("the quick brown fox "[(k + seed) % 20]);
            }
            break;
        case 1:
            for (size_t k = 0; k < kPage; k++) {
                p[k] = uint8_t(rng());
            }
            break;
        default:
            break;
        }
    }
    return v;
}

struct Channel {
    std::unique_ptr<MultiFDCompressor> c;
    std::unique_ptr<MultiFDDecompressor> d;
    std::vector<uint8_t> z = std::vector<uint8_t>(MULTIFD_COMPRESSED_MAX);
};

Channel open_channel(MultiFDCompression m, int level)
{
    const MultiFDMethod &method = multifd_method(m);
    auto c = method.make_compressor(level);
    auto d = method.make_decompressor();
    REQUIRE(c.ok());
    REQUIRE(d.ok());
    return {std::move(*c), std::move(*d)};
}

size_t compress(Channel &ch, const std::vector<uint8_t> &pages)
{
    uint32_t n = uint32_t(pages.size() / kPage);
    std::vector<const uint8_t *> in(n);
    for (uint32_t i = 0; i < n; i++) {
        in[i] = pages.data() + i * kPage;
    }
    auto r = ch.c->compress(in.data(), n, ch.z.data(), ch.z.size());
    REQUIRE(r.ok());
    return *r;
}

Status decompress(Channel &ch, size_t len, std::vector<uint8_t> &out)
{
    uint32_t n = uint32_t(out.size() / kPage);
    std::vector<uint8_t *> pages(n);
    for (uint32_t i = 0; i < n; i++) {
        pages[i] = out.data() + i * kPage;
    }
    return ch.d->decompress(ch.z.data(), len, pages.data(), n);
}

} // namespace

TEST_CASE("method table and names", "[compression]")
{
    CHECK(multifd_compression_parse("zlib") == MultiFDCompression::Zlib);
    CHECK(multifd_compression_parse("zstd") == MultiFDCompression::Zstd);
    CHECK(multifd_compression_parse("none") == MultiFDCompression::None);
    CHECK_FALSE(multifd_compression_parse("qpl").has_value());
    CHECK(multifd_method(MultiFDCompression::Zlib).flag == 0x02);
    CHECK(multifd_method(MultiFDCompression::Zstd).flag == 0x04);
    CHECK(multifd_method(MultiFDCompression::None).flag == 0);
    CHECK_FALSE(multifd_method(MultiFDCompression::None).make_compressor(1).ok());
}

TEST_CASE("streams round-trip packet after packet", "[compression]")
{
    auto m = GENERATE(MultiFDCompression::Zlib, MultiFDCompression::Zstd);
    int level = GENERATE(0, 1, 9);
    Channel ch = open_channel(m, level);
    // One stream over many packets: each must inflate on its own, with the
    // state the previous ones left.
    for (unsigned packet = 0; packet < 6; packet++) {
        uint32_t n = packet == 3 ? 1 : MULTIFD_PACKET_PAGES;
        auto pages = make_pages(n, packet);
        size_t len = compress(ch, pages);
        CHECK(len > 0);
        CHECK(len <= MULTIFD_COMPRESSED_MAX);
        std::vector<uint8_t> out(pages.size(), 0xee);
        REQUIRE(decompress(ch, len, out).ok());
        CHECK(out == pages);
    }
}

TEST_CASE("zlib output is a zlib stream flushed, not finished", "[compression]")
{
    Channel ch = open_channel(MultiFDCompression::Zlib, 1);
    auto pages = make_pages(2, 7);
    size_t len = compress(ch, pages);
    REQUIRE(len > 6);
    CHECK(ch.z[0] == 0x78); // zlib header: deflate, 32 KiB window
    // Z_SYNC_FLUSH ends with an empty stored block: 00 00 ff ff.
    const uint8_t marker[] = {0x00, 0x00, 0xff, 0xff};
    CHECK(std::memcmp(ch.z.data() + len - 4, marker, 4) == 0);
}

TEST_CASE("broken payloads fail, never overflow a page", "[compression]")
{
    auto m = GENERATE(MultiFDCompression::Zlib, MultiFDCompression::Zstd);
    auto pages = make_pages(4, 1);

    SECTION("fewer pages than the header claims")
    {
        Channel ch = open_channel(m, 1);
        size_t len = compress(ch, pages);
        std::vector<uint8_t> out(5 * kPage);
        CHECK_FALSE(decompress(ch, len, out).ok());
    }
    SECTION("more data than the header's pages")
    {
        Channel ch = open_channel(m, 1);
        size_t len = compress(ch, pages);
        std::vector<uint8_t> out(3 * kPage);
        auto st = decompress(ch, len, out);
        REQUIRE_FALSE(st.ok());
        CHECK(st.error().message().find("more than its 3 pages") != std::string::npos);
    }
    SECTION("truncated payload")
    {
        Channel ch = open_channel(m, 1);
        size_t len = compress(ch, pages);
        std::vector<uint8_t> out(pages.size());
        CHECK_FALSE(decompress(ch, len / 2, out).ok());
    }
    SECTION("garbage")
    {
        Channel ch = open_channel(m, 1);
        std::mt19937 rng(3);
        for (auto &b : ch.z) {
            b = uint8_t(rng());
        }
        std::vector<uint8_t> out(pages.size());
        CHECK_FALSE(decompress(ch, 4096, out).ok());
    }
}
