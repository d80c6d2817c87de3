#include <catch2/catch.hpp>

#include <cstring>

#include "protocol/multifd_packet.h"
#include "protocol/wire.h"

using namespace qmigd;

namespace {

const std::vector<RamBlockDesc> kBlocks = {{"mem", 64 * TARGET_PAGE_SIZE},
                                           {"other", 8 * TARGET_PAGE_SIZE}};

std::string decode_error(const uint8_t *h)
{
    auto r = multifd_packet_decode(h, kBlocks);
    REQUIRE_FALSE(r.ok());
    return r.error().message();
}

} // namespace

TEST_CASE("init message round trip and checks", "[multifd]")
{
    Uuid u{};
    uint8_t buf[MULTIFD_INIT_SIZE];
    multifd_init_encode(u, 3, buf);
    CHECK(get_be32(buf) == 0x11223344);
    CHECK(get_be32(buf + 4) == 1);
    CHECK(buf[24] == 3);
    auto id = multifd_init_decode(buf, u, 4);
    REQUIRE(id.ok());
    CHECK(*id == 3);
    // QEMU lets id == channels through; we do not.
    CHECK(multifd_init_decode(buf, u, 3).error().message() ==
          "multifd: received channel id 3 is greater than number of channels 3");
    Uuid other{};
    other[15] = 1;
    CHECK(multifd_init_decode(buf, other, 4).error().message() ==
          "multifd: received uuid '00000000-0000-0000-0000-000000000000' and expected uuid "
          "'00000000-0000-0000-0000-000000000001' for channel 3");
    buf[0] = 0;
    CHECK(multifd_init_decode(buf, u, 4).error().message() ==
          "multifd: received packet magic 223344 expected 11223344");
    buf[0] = 0x11;
    buf[7] = 2;
    CHECK(multifd_init_decode(buf, u, 4).error().message() ==
          "multifd: received packet version 2 expected 1");
}

TEST_CASE("packet header round trip", "[multifd]")
{
    uint8_t h[MULTIFD_PACKET_HEADER_SIZE];
    uint64_t offs[] = {5 * TARGET_PAGE_SIZE, 6 * TARGET_PAGE_SIZE, 0};
    multifd_packet_encode(h, 0, 77, "other", offs, 2, 1, 2 * TARGET_PAGE_SIZE);
    CHECK(get_be32(h + 12) == 128);
    CHECK(get_be32(h + 20) == 2 * TARGET_PAGE_SIZE);
    auto p = multifd_packet_decode(h, kBlocks);
    REQUIRE(p.ok());
    CHECK(p->block == 1);
    CHECK(p->normal_pages == 2);
    CHECK(p->zero_pages == 1);
    CHECK(p->packet_num == 77);
    CHECK(p->offsets[0] == 5 * TARGET_PAGE_SIZE);
    CHECK(p->offsets[2] == 0);
    CHECK(p->data_bytes() == 2 * TARGET_PAGE_SIZE);
    CHECK_FALSE(p->is_sync());

    multifd_packet_encode(h, MULTIFD_FLAG_SYNC, 78, "", nullptr, 0, 0, 0);
    auto s = multifd_packet_decode(h, kBlocks);
    REQUIRE(s.ok());
    CHECK(s->is_sync());
    CHECK(get_be32(h + 12) == 0);
}

TEST_CASE("packet header validation", "[multifd]")
{
    uint8_t h[MULTIFD_PACKET_HEADER_SIZE];
    uint64_t offs[] = {0, TARGET_PAGE_SIZE};
    auto fresh = [&] { multifd_packet_encode(h, 0, 1, "mem", offs, 1, 1, TARGET_PAGE_SIZE); };

    fresh();
    put_be32(h, 0x1);
    CHECK(decode_error(h) == "multifd: received packet magic 1, expected 11223344");
    fresh();
    put_be32(h + 4, 9);
    CHECK(decode_error(h) == "multifd: received packet version 9, expected 1");
    fresh();
    put_be32(h + 12, 129);
    CHECK(decode_error(h) == "multifd: received packet with 129 pages, expected 128");
    fresh();
    put_be32(h + 16, 129);
    put_be32(h + 12, 128);
    CHECK(decode_error(h).find("non-zero pages, which exceeds") != std::string::npos);
    fresh();
    put_be32(h + 32, 128);
    CHECK(decode_error(h) == "multifd: received packet with 128 zero pages, expected maximum 127");
    fresh();
    put_be32(h + 20, 1);
    CHECK(decode_error(h).find("next_packet_size 1 for 1 pages") != std::string::npos);
    fresh();
    std::memcpy(h + 64, "nosuch", 7);
    CHECK(decode_error(h) == "multifd: unknown ram block nosuch");
    fresh();
    put_be64(h + 320, 64 * TARGET_PAGE_SIZE);
    CHECK(decode_error(h) == "multifd: offset too long 262144 (max 40000)");
    fresh();
    put_be64(h + 328, 100);
    CHECK(decode_error(h) == "multifd: unaligned page offset 0x64");
    fresh();
    put_be32(h + 8, 0x02);
    CHECK(decode_error(h) == "multifd: flags received 2 flags expected 0");
    fresh();
    put_be32(h + 8, MULTIFD_FLAG_DEVICE_STATE);
    CHECK(decode_error(h).find("multifd: flags received 40") == 0);
    // A name that fills all 256 bytes is cut at 255, never read past.
    fresh();
    std::memset(h + 64, 'a', 256);
    CHECK(decode_error(h).find("multifd: unknown ram block aaaa") == 0);
}

TEST_CASE("compressed packet headers", "[multifd][compression]")
{
    uint8_t h[MULTIFD_PACKET_HEADER_SIZE];
    uint64_t offs[] = {0, TARGET_PAGE_SIZE};
    multifd_packet_encode(h, MULTIFD_FLAG_ZSTD, 1, "mem", offs, 1, 1, 37);
    auto p = multifd_packet_decode(h, kBlocks, MULTIFD_FLAG_ZSTD);
    REQUIRE(p.ok());
    CHECK(p->next_packet_size == 37);
    CHECK(p->data_bytes() == 37);
    // The method must be the receiver's, in QEMU's words.
    auto z = multifd_packet_decode(h, kBlocks, MULTIFD_FLAG_ZLIB);
    REQUIRE_FALSE(z.ok());
    CHECK(z.error().message() == "multifd: flags received 4 flags expected 2");
    // An uncompressed receiver sees a method it does not use.
    CHECK(decode_error(h) == "multifd: flags received 4 flags expected 0");
    // Payload bounds: none for zero-only packets, at most twice a packet.
    multifd_packet_encode(h, MULTIFD_FLAG_ZLIB, 2, "mem", offs, 0, 2, 10);
    CHECK_FALSE(multifd_packet_decode(h, kBlocks, MULTIFD_FLAG_ZLIB).ok());
    multifd_packet_encode(h, MULTIFD_FLAG_ZLIB, 2, "mem", offs, 1, 0, 0);
    CHECK_FALSE(multifd_packet_decode(h, kBlocks, MULTIFD_FLAG_ZLIB).ok());
    multifd_packet_encode(h, MULTIFD_FLAG_ZLIB, 2, "mem", offs, 1, 0,
                          uint32_t(MULTIFD_COMPRESSED_MAX + 1));
    CHECK_FALSE(multifd_packet_decode(h, kBlocks, MULTIFD_FLAG_ZLIB).ok());
    multifd_packet_encode(h, MULTIFD_FLAG_ZLIB, 2, "mem", offs, 1, 0,
                          uint32_t(MULTIFD_COMPRESSED_MAX));
    CHECK(multifd_packet_decode(h, kBlocks, MULTIFD_FLAG_ZLIB).ok());
    // A SYNC packet carries no method, as QEMU sends it.
    multifd_packet_encode(h, MULTIFD_FLAG_SYNC, 3, "", nullptr, 0, 0, 0);
    CHECK(multifd_packet_decode(h, kBlocks, MULTIFD_FLAG_ZLIB).ok());
}
