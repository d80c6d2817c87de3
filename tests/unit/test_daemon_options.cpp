#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/ram_blocks.h"
#include "daemon/socket_io.h"
#include "protocol/wire.h"

using namespace qmigd;

TEST_CASE("--ram sizes: QEMU's syntax, and no silent wrap", "[daemon]")
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
    CHECK(parse_size("1.5M", &v)); // memory-backend-file,size=1.5M: QEMU 10 takes it
    CHECK(v == 3u << 19);
    CHECK(parse_size("0x100000", &v));
    CHECK(v == 1u << 20);
    CHECK(parse_size(" 1", &v)); // leading blanks, as QEMU's strtosz
    CHECK_FALSE(parse_size("1.5", &v)); // a fraction of a byte
    CHECK_FALSE(parse_size("1Kb", &v));
    CHECK_FALSE(parse_size("", &v));
    CHECK_FALSE(parse_size(std::string("1\0x", 3), &v)); // found by fuzz_ram_option
    auto spec = ram_block_spec_parse("mem=/dev/shm/x,size=16777216T");
    REQUIRE_FALSE(spec.ok());
    CHECK(spec.error().message().find("Parameter 'size' expects a size value (bytes, or with a "
                                      "unit: 256M, 1.5G, 0x10000000)") != std::string::npos);
}

TEST_CASE("wire names become printable text", "[protocol]")
{
    CHECK(wire_text("pc-q35") == "pc-q35");
    CHECK(wire_text(std::string("\xff\xfe\x01", 3)) == "\\xff\\xfe\\x01");
    CHECK(wire_text("a\\b") == "a\\x5cb");
    CHECK(wire_text(std::string("\0x", 2)) == "\\x00x");
}

namespace {

// A connected TCP pair over `loopback` (an IPv4 or IPv6 address); -1s
// where this host has no such address.
std::pair<int, int> tcp_pair(int family, const char *loopback)
{
    int l = socket(family, SOCK_STREAM, 0);
    sockaddr_storage a{};
    socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    a.ss_family = sa_family_t(family);
    void *where = family == AF_INET
                      ? static_cast<void *>(&reinterpret_cast<sockaddr_in &>(a).sin_addr)
                      : static_cast<void *>(&reinterpret_cast<sockaddr_in6 &>(a).sin6_addr);
    inet_pton(family, loopback, where);
    auto *sa = reinterpret_cast<sockaddr *>(&a);
    if (l < 0 || bind(l, sa, len) < 0 || listen(l, 1) < 0 || getsockname(l, sa, &len) < 0) {
        if (l >= 0) {
            close(l);
        }
        return {-1, -1};
    }
    int c = socket(family, SOCK_STREAM, 0);
    int ok = connect(c, sa, len);
    int s = ok == 0 ? accept(l, nullptr, nullptr) : -1;
    close(l);
    return {c, s};
}

} // namespace

TEST_CASE("peer_is_local: loopback TCP is local, a unix socket is not TCP", "[daemon]")
{
    for (auto [family, addr] : {std::pair{AF_INET, "127.0.0.1"}, std::pair{AF_INET6, "::1"}}) {
        auto [c, s] = tcp_pair(family, addr);
        if (c < 0) {
            WARN("no " << addr << " on this host");
            continue;
        }
        CHECK(peer_is_local(c));
        CHECK(peer_is_local(s));
        set_send_buffer(c, 65536);
        int v = 0;
        socklen_t vlen = sizeof(v);
        getsockopt(c, SOL_SOCKET, SO_SNDBUF, &v, &vlen);
        CHECK(v == 2 * 65536); // the kernel doubles it for its bookkeeping
        close(c);
        close(s);
    }
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    CHECK_FALSE(peer_is_local(sv[0]));
    close(sv[0]);
    close(sv[1]);
}
