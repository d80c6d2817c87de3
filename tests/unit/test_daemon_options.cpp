#include <catch2/catch.hpp>

#include "daemon/ram_blocks.h"
#include "protocol/wire.h"

using namespace qmigd;

TEST_CASE("--ram sizes: units, and no silent wrap", "[daemon]")
{
    uint64_t v = 0;
    CHECK(parse_size("4096", &v));
    CHECK(v == 4096);
    CHECK(parse_size("2M", &v));
    CHECK(v == 2u << 20);
    CHECK(parse_size("1t", &v));
    CHECK(v == uint64_t(1) << 40);
    CHECK(parse_size("16383P", &v));
    CHECK_FALSE(parse_size("16777216T", &v)); // 2^64: QEMU refuses it too
    CHECK_FALSE(parse_size("16384P", &v));
    CHECK_FALSE(parse_size("99999999999999999999", &v));
    CHECK_FALSE(parse_size("-1", &v));
    CHECK_FALSE(parse_size(" 1", &v));
    CHECK_FALSE(parse_size("1Kb", &v));
    CHECK_FALSE(parse_size("", &v));
    CHECK_FALSE(parse_size(std::string("1\0x", 3), &v)); // found by fuzz_ram_option
    auto spec = ram_block_spec_parse("mem=/dev/shm/x,size=16777216T");
    REQUIRE_FALSE(spec.ok());
    CHECK(spec.error().message().find("Parameter 'size' expects a size value") !=
          std::string::npos);
}

TEST_CASE("wire names become printable text", "[protocol]")
{
    CHECK(wire_text("pc-q35") == "pc-q35");
    CHECK(wire_text(std::string("\xff\xfe\x01", 3)) == "\\xff\\xfe\\x01");
    CHECK(wire_text("a\\b") == "a\\x5cb");
    CHECK(wire_text(std::string("\0x", 2)) == "\\x00x");
}
