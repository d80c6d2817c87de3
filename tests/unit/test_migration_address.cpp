#include <catch2/catch.hpp>

#include "daemon/io/migration_address.h"

using namespace qmigd;

namespace {

// prefix, n copies of c, suffix: built by appending, since GCC 12 warns
// (-Warray-bounds, falsely) on "literal" + std::string(n, c) + "literal".
std::string around(const char *prefix, size_t n, char c, const char *suffix)
{
    return std::string(prefix).append(n, c).append(suffix);
}

} // namespace

TEST_CASE("migration URIs: tcp and unix, QEMU's errors", "[daemon][io]")
{
    auto a = parse_socket_uri("tcp:127.0.0.1:4444");
    REQUIRE(a);
    CHECK(a->type == SocketAddress::Type::Inet);
    CHECK(a->host == "127.0.0.1");
    CHECK(a->port == 4444);
    CHECK(a->uri() == "tcp:127.0.0.1:4444");

    a = parse_socket_uri("tcp:[::1]:0");
    REQUIRE(a);
    CHECK(a->host == "::1");
    CHECK(socket_address_json(*a)["ipv6"] == true);

    a = parse_socket_uri("tcp::5"); // every interface
    REQUIRE(a);
    CHECK(a->host.empty());
    CHECK(socket_address_json(*a)["host"] == "0.0.0.0");

    a = parse_socket_uri("unix:/run/x.sock");
    REQUIRE(a);
    CHECK(a->type == SocketAddress::Type::Unix);
    CHECK(a->path == "/run/x.sock");
    CHECK(a->uri() == "unix:/run/x.sock");
    CHECK(a->display() == "/run/x.sock");
    CHECK(socket_address_json(*a) == nlohmann::json{{"type", "unix"}, {"path", "/run/x.sock"}});

    CHECK(parse_socket_uri("bogus:1").error().message() == "unknown migration protocol: bogus:1");
    CHECK(parse_socket_uri("tcp:host").error().message() == "error parsing address 'host'");
    CHECK(parse_socket_uri("tcp:h:65536").error().message() == "error parsing address 'h:65536'");
    CHECK(parse_socket_uri("tcp:h:").error().message() == "error parsing address 'h:'");

    CHECK(check_unix_path(std::string(107, 'p')));
    CHECK(check_unix_path(std::string(108, 'p')).error().message() ==
          around("UNIX socket path '", 108, 'p', "' is too long"));
}

TEST_CASE("tcp: hosts as QEMU's inet_parse() reads them", "[daemon][io]")
{
    // An empty bracket is no host (QEMU: "error parsing IPv6 address"),
    // not every interface; a bare IPv6 address is not a host either.
    CHECK_FALSE(parse_socket_uri("tcp:[]:0"));
    CHECK(parse_socket_uri("tcp:[]:0").error().message() ==
          "error parsing IPv6 address '[]:0'");
    CHECK_FALSE(parse_socket_uri("tcp:::1:0"));
    CHECK_FALSE(parse_socket_uri("tcp:[::1:0"));
    CHECK_FALSE(parse_socket_uri(around("tcp:", 65, 'h', ":0")));
    CHECK(parse_socket_uri(around("tcp:", 64, 'h', ":0")));
    CHECK_FALSE(parse_socket_uri("tcp:h:+1"));
    auto a = parse_socket_uri("tcp::0");
    REQUIRE(a);
    CHECK(a->host.empty());
    // A channel's InetSocketAddress takes a bare IPv6 host.
    auto list = nlohmann::json::parse(R"([{"channel-type":"main","addr":{"transport":"socket",
        "type":"inet","host":"::1","port":"4444"}}])");
    auto c = migration_channels_address(list, false);
    REQUIRE(c);
    CHECK(c->socket.host == "::1");
    CHECK(c->socket.port == 4444);
}

TEST_CASE("migration URIs: exec, and multifd needs a multi-channel transport", "[daemon][io]")
{
    auto a = parse_migration_uri("exec:gzip -dc < /x.gz");
    REQUIRE(a);
    CHECK(a->transport == MigrationAddress::Transport::Exec);
    CHECK(a->argv == std::vector<std::string>{"/bin/sh", "-c", "gzip -dc < /x.gz"});
    CHECK(a->uri() == "exec:gzip -dc < /x.gz");
    CHECK_FALSE(a->multi_channel(false));
    CHECK(check_transport_for_multifd(*a, false, false));
    CHECK(check_transport_for_multifd(*a, true, false).error().message() ==
          "Migration requires multi-channel URIs (e.g. tcp)");
    CHECK(check_transport_for_multifd(*a, false, true).error().message() ==
          "Migration requires seekable transport (e.g. file)");

    a = parse_migration_uri("unix:/s");
    REQUIRE(a);
    CHECK(a->transport == MigrationAddress::Transport::Socket);
    CHECK(a->socket.path == "/s");
    CHECK(check_transport_for_multifd(*a, true, false));
    CHECK(check_transport_for_multifd(*a, true, true).error().message() ==
          "Migration requires seekable transport (e.g. file)");

    CHECK(parse_migration_uri("vsock:3:4").error().message() ==
          "unknown migration protocol: vsock:3:4");
}

TEST_CASE("migration URIs: file with QEMU's offset option", "[daemon][io]")
{
    auto a = parse_migration_uri("file:/var/tmp/vm");
    REQUIRE(a);
    CHECK(a->transport == MigrationAddress::Transport::File);
    CHECK(a->filename == "/var/tmp/vm");
    CHECK(a->offset == 0);
    CHECK_FALSE(a->multi_channel(false)); // no mapped-ram: one channel
    CHECK(a->multi_channel(true));         // mapped-ram: one descriptor per channel
    CHECK(check_transport_for_multifd(*a, true, true));

    a = parse_migration_uri("file:/a,b,offset=0x1000");
    REQUIRE(a);
    CHECK(a->filename == "/a,b");
    CHECK(a->offset == 0x1000);
    CHECK(a->uri() == "file:/a,b,offset=4096");

    a = parse_migration_uri("file:/x,offset=4k");
    REQUIRE(a);
    CHECK(a->offset == 4096);

    CHECK(parse_migration_uri("file:/x,offset=1Q").error().message() ==
          "file URI has bad offset 1Q: Invalid argument");
    CHECK(parse_migration_uri("file:/x,offset=").error().message() ==
          "file URI has bad offset : Invalid argument");
    CHECK(parse_migration_uri("file:/x,offset=99999999999999999999").error().message() ==
          "file URI has bad offset 99999999999999999999: Numerical result out of range");
}

TEST_CASE("channels: QEMU 10's visitor errors and the main channel", "[daemon][io][qapi]")
{
    auto check = [](const char *text) -> std::string {
        auto e = qapi_check(nlohmann::json::parse(text), migration_channel_list_type(), "channels",
                            "channels");
        return e ? e->desc : "OK";
    };
    // Each text is what QEMU 10.0 answers (see test_transports.py).
    CHECK(check("{}") == "Invalid parameter type for 'channels', expected: array");
    CHECK(check("[1]") == "Invalid parameter type for 'channels[0]', expected: object");
    CHECK(check("[{}]") == "Parameter 'channels[0].channel-type' is missing");
    CHECK(check(R"([{"channel-type":"bogus","addr":{}}])") ==
          "Parameter 'channel-type' does not accept value 'bogus'");
    CHECK(check(R"([{"channel-type":"main","addr":{"transport":"socket","type":"inet"}}])") ==
          "Parameter 'channels[0].addr.host' is missing");
    CHECK(check(R"([{"channel-type":"main","addr":{"transport":"socket","type":"inet",
                     "host":"h","port":"2","to":70000}}])") == "Parameter 'to' expects uint16_t");
    CHECK(check(R"([{"channel-type":"main","addr":{"transport":"socket","type":"inet",
                     "host":"h","port":"2","x":1}}])") ==
          "Parameter 'channels[0].addr.x' is unexpected");
    CHECK(check(R"([{"channel-type":"main","addr":{"transport":"file","filename":"/x",
                     "offset":"1"}}])") == "Parameter 'channels[0].addr.offset' expects uint64");
    CHECK(check(R"([{"channel-type":"main","addr":{"transport":"exec","args":[1]}}])") ==
          "Invalid parameter type for 'channels[0].addr.args[0]', expected: string");

    auto list = nlohmann::json::parse(
        R"([{"channel-type":"main","addr":{"transport":"exec","args":["cat","/f"]}}])");
    REQUIRE(check(list.dump().c_str()) == "OK");
    auto a = migration_channels_address(list, false);
    REQUIRE(a);
    CHECK(a->argv == std::vector<std::string>{"cat", "/f"});
    auto two = nlohmann::json::array({list[0], list[0]});
    CHECK(migration_channels_address(two, false).error().message() ==
          "Channel list has more than one main entry");
    CHECK(migration_channels_address(two, true).error().message() ==
          "Channel list must have only one entry, for type 'main'");
}
