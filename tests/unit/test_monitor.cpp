#include <catch2/catch.hpp>

#include <fstream>

#include "monitor/hmp.h"
#include "monitor/json_splitter.h"
#include "monitor/migration_config.h"
#include "monitor/qapi_visit.h"
#include "monitor/qemu_size.h"
#include "monitor/qmp_server.h"

using namespace qmigd;

TEST_CASE("JSON splitter: objects by brackets, scalars by newline", "[monitor]")
{
    JsonSplitter s;
    auto a = s.feed("{\"execute\": \"x\"}{\"a\": \"}\"}", 27);
    REQUIRE(a.size() == 2);
    CHECK(a[1].text == "{\"a\": \"}\"}");
    CHECK(s.feed("{\"unterminated\": ", 17).empty());
    CHECK(s.pending() > 0);
    auto b = s.feed("1}\n42\n", 6);
    REQUIRE(b.size() == 2);
    CHECK(b[1].text == "42");
}

TEST_CASE("JSON splitter: QEMU's nesting, size and token limits, then recovery", "[monitor]")
{
    JsonSplitter s(4096);
    // 1024 levels pass, 1025 do not; the deep text is eaten, not buffered.
    std::string ok = std::string(1024, '[') + std::string(1024, ']');
    auto a = s.feed(ok.data(), ok.size());
    REQUIRE(a.size() == 1);
    CHECK(a[0].error.empty());
    std::string deep = std::string(200000, '[');
    auto b = s.feed(deep.data(), deep.size());
    REQUIRE(b.size() == 1);
    CHECK(b[0].error == "JSON nesting depth limit exceeded");
    CHECK(s.pending() == 0);
    std::string close = std::string(200000, ']') + "{\"execute\":\"x\"}";
    auto c = s.feed(close.data(), close.size());
    REQUIRE(c.size() == 1);
    CHECK(c[0].text == "{\"execute\":\"x\"}");
    // Size: over the limit is one error; a newline ends a broken scalar.
    // Appended: GCC 12 warns falsely on "literal" + std::string(n, c) + "literal".
    std::string big = std::string("{\"a\":\"").append(5000, 'x').append("\"}");
    auto d = s.feed(big.data(), big.size());
    REQUIRE(d.size() == 1);
    CHECK(d[0].error == "JSON token size limit exceeded");
    CHECK(s.pending() == 0);
    auto e = s.feed("{}\n", 3);
    REQUIRE(e.size() == 1);
    CHECK(e[0].text == "{}");
}

TEST_CASE("JSON splitter: token count limit", "[monitor]")
{
    JsonSplitter s;
    std::string many = "[";
    for (size_t i = 0; i < JsonSplitter::kMaxTokenCount / 2 + 10; i++) {
        many += "1,";
    }
    auto a = s.feed(many.data(), many.size());
    REQUIRE(a.size() == 1);
    CHECK(a[0].error == "JSON token count limit exceeded");
}

namespace {

// A monitor with the two migration setters registered as the daemon has
// them (QmpServer::dispatch never touches the loop).
struct ConfigMonitor {
    MigrationConfig c;
    QmpServer server{nullptr};
    ConfigMonitor()
    {
        server.register_command("migrate-set-parameters", &MigrationConfig::set_parameters_args(),
                                [this](const json &a) -> QmpResult {
                                    if (auto e = c.set_parameters(a)) {
                                        return *e;
                                    }
                                    return json::object();
                                });
        server.register_command("migrate-set-capabilities",
                                &MigrationConfig::set_capabilities_args(),
                                [this](const json &a) -> QmpResult {
                                    if (auto e = c.set_capabilities(a)) {
                                        return *e;
                                    }
                                    return json::object();
                                });
    }
    std::optional<QmpError> set(const char *command, const json &args)
    {
        QmpResult r = server.dispatch(command, args);
        if (auto *e = std::get_if<QmpError>(&r)) {
            return *e;
        }
        return std::nullopt;
    }
};

std::string error_of(const QmpResult &r)
{
    auto *e = std::get_if<QmpError>(&r);
    return e ? e->desc : "";
}

} // namespace

TEST_CASE("commands: arguments checked once, before the handler, in QEMU's order and words",
          "[monitor]")
{
    QmpServer server(nullptr);
    int ran = 0;
    const QapiType state = qapi_enum({"none", "active"});
    const QapiType levels = qapi_list_of(&kQapiUint8);
    const QapiType args = qapi_struct({{"state", &state},
                                       {"cpu-index", &kQapiInt, true},
                                       {"creds", &kQapiStrOrNull, true},
                                       {"levels", &levels, true}});
    server.register_command("cmd", &args, [&](const json &) -> QmpResult {
        ran++;
        return json::object();
    });
    server.register_command("none", &kQapiNoArgs, [&](const json &) -> QmpResult {
        ran++;
        return json::object();
    });
    auto run = [&](const char *name, const char *text) {
        return error_of(server.dispatch(name, json::parse(text)));
    };
    // Members in schema order, each missing or of the wrong type when
    // reached; members the type lacks only once all are done (as measured
    // against QEMU 10's migrate-continue and human-monitor-command).
    CHECK(run("cmd", R"({"zzz": 1})") == "Parameter 'state' is missing");
    CHECK(run("cmd", R"({"state": 5, "zzz": 1})") ==
          "Invalid parameter type for 'state', expected: string");
    CHECK(run("cmd", R"({"state": "x", "zzz": 1})") == "Parameter 'state' does not accept value 'x'");
    CHECK(run("cmd", R"({"state": "none", "zzz": 1})") == "Parameter 'zzz' is unexpected");
    CHECK(run("cmd", R"({"state": "none", "cpu-index": "1", "zzz": 1})") ==
          "Invalid parameter type for 'cpu-index', expected: integer");
    CHECK(run("cmd", R"({"state": "none", "cpu-index": 18446744073709551615})") ==
          "Invalid parameter type for 'cpu-index', expected: integer");
    CHECK(run("cmd", R"({"state": "none", "creds": 5})") ==
          "Invalid parameter type for 'creds', expected: StrOrNull");
    // A list's elements have no name: QEMU says "null" where it names the
    // member alone, the full path elsewhere.
    CHECK(run("cmd", R"({"state": "none", "levels": [1, 256]})") ==
          "Parameter 'null' expects uint8_t");
    CHECK(run("cmd", R"({"state": "none", "levels": [1, "2"]})") ==
          "Parameter 'levels[1]' expects uint64");
    CHECK(run("none", R"({"a": 1})") == "Parameter 'a' is unexpected");
    CHECK(ran == 0);
    CHECK(run("cmd", R"({"state": "active", "cpu-index": -1, "creds": null, "levels": [255]})")
              .empty());
    CHECK(run("none", "{}").empty());
    CHECK(ran == 2);
}

TEST_CASE("parameters: QEMU's types, ranges and texts; all or nothing", "[monitor]")
{
    ConfigMonitor m;
    MigrationConfig &c = m.c;
    auto err = [&](json args) {
        auto e = m.set("migrate-set-parameters", args);
        REQUIRE(e.has_value());
        return e->desc;
    };
    CHECK(err({{"multifd-channels", 0}}) ==
          "Parameter 'multifd_channels' expects a value between 1 and 255");
    CHECK(err({{"multifd-channels", 256}}) == "Parameter 'multifd-channels' expects uint8_t");
    CHECK(err({{"multifd-channels", "4"}}) == "Parameter 'multifd-channels' expects uint64");
    CHECK(err({{"zero-page-detection", "foo"}}) ==
          "Parameter 'zero-page-detection' does not accept value 'foo'");
    CHECK(err({{"zero-page-detection", 1}}) ==
          "Invalid parameter type for 'zero-page-detection', expected: string");
    CHECK(err({{"downtime-limit", 2000001}}) ==
          "Parameter 'downtime_limit' expects an integer in the range of 0 to (2000 * 1000) ms");
    CHECK(err({{"downtime-limit", 1.5}}) == "Parameter 'downtime-limit' expects uint64");
    CHECK(err({{"max-bandwidth", "x"}}) == "Parameter 'max-bandwidth' expects uint64");
    CHECK(err({{"foo-bar", 1}}) == "Parameter 'foo-bar' is unexpected");
    CHECK(err({{"multifd-channels", 4}, {"foo-bar", 1}}) == "Parameter 'foo-bar' is unexpected");
    CHECK(c.multifd_channels() == 2); // nothing changed
    REQUIRE_FALSE(c.set_parameters({{"multifd-channels", 8}, {"max-bandwidth", -1}}));
    CHECK(c.multifd_channels() == 8);
    CHECK(c.max_bandwidth() == UINT64_MAX);
    // Debian's QEMU 10 has zlib and zstd; qpl, uadk and qatzip are compiled out.
    REQUIRE_FALSE(c.set_parameters({{"multifd-compression", "zstd"}, {"multifd-zstd-level", 20}}));
    CHECK(c.multifd_compression() == "zstd");
    CHECK(c.multifd_compression_level() == 20);
    CHECK(err({{"multifd-compression", "qpl"}}) ==
          "Parameter 'multifd-compression' does not accept value 'qpl'");
    CHECK(err({{"multifd-zstd-level", 21}}) ==
          "Parameter 'multifd_zstd_level' expects a value between 0 and 20");
    CHECK(err({{"multifd-zlib-level", 10}}) ==
          "Parameter 'multifd_zlib_level' expects a value between 0 and 9");
    // Types of every member before any range, and before unexpected ones.
    CHECK(err({{"multifd-channels", 0}, {"zero-page-detection", 3}}) ==
          "Invalid parameter type for 'zero-page-detection', expected: string");
    CHECK(err({{"multifd-channels", "4"}, {"foo-bar", 1}}) ==
          "Parameter 'multifd-channels' expects uint64");
    // tls-* are StrOrNull: null is QEMU's way to say "".
    CHECK(err({{"tls-creds", 5}}) == "Invalid parameter type for 'tls-creds', expected: StrOrNull");
    REQUIRE_FALSE(m.set("migrate-set-parameters", {{"tls-hostname", "h"}}));
    REQUIRE_FALSE(m.set("migrate-set-parameters", {{"tls-hostname", nullptr}}));
    CHECK(c.parameters()["tls-hostname"] == "");
}

TEST_CASE("capabilities: QEMU's list; unimplemented ones refused", "[monitor]")
{
    ConfigMonitor m;
    MigrationConfig &c = m.c;
    auto caps = c.capabilities();
    REQUIRE(caps.size() == 22);
    CHECK(caps[0]["capability"] == "xbzrle");
    CHECK(caps[21]["capability"] == "mapped-ram");
    auto set = [&](json list) { return m.set("migrate-set-capabilities", {{"capabilities", list}}); };
    CHECK_FALSE(set(json::array({{{"capability", "multifd"}, {"state", true}}})));
    CHECK(c.capability("multifd"));
    auto e = set(json::array({{{"capability", "foo"}, {"state", true}}}));
    REQUIRE(e);
    CHECK(e->desc == "Parameter 'capability' does not accept value 'foo'");
    e = set(json::array({{{"capability", "multifd"}, {"state", 1}}}));
    REQUIRE(e);
    CHECK(e->desc == "Invalid parameter type for 'capabilities[0].state', expected: boolean");
    e = set(json::array({{{"capability", "xbzrle"}, {"state", true}}}));
    REQUIRE(e);
    CHECK(e->desc == "Multifd is not compatible with xbzrle");
    e = set(json::array({{{"capability", "x-colo"}, {"state", true}}}));
    REQUIRE(e);
    CHECK(e->desc == "Capability 'x-colo' is not supported by qmigd: COLO runs the VM on both "
                     "sides at once, and qmigd runs no vCPU");
    e = set(json::array({{{"capability", "release-ram"}, {"state", true}}}));
    REQUIRE(e);
    CHECK(e->desc.find("Capability 'release-ram' is not supported by qmigd: the source keeps") ==
          0);
    // multifd is on from above: postcopy-ram next to it is refused in QEMU's words.
    e = set(json::array({{{"capability", "postcopy-ram"}, {"state", true}}}));
    REQUIRE(e);
    CHECK(e->desc == "Postcopy is not yet compatible with multifd");
    CHECK_FALSE(c.capability("postcopy-ram"));
    e = m.set("migrate-set-capabilities", {{"capabilities", 5}});
    REQUIRE(e);
    CHECK(e->desc == "Invalid parameter type for 'capabilities', expected: array");
    e = set(json::array({{{"state", true}}}));
    REQUIRE(e);
    CHECK(e->desc == "Parameter 'capabilities[0].capability' is missing");
}

// Each row: capabilities set together, and QEMU 10's refusal (measured
// against a live QEMU 10.0.2, tests/integration/test_capabilities.py
// compares them again), or "" where QEMU takes them.
TEST_CASE("capabilities: the combinations QEMU refuses, in its words", "[monitor]")
{
    struct Row {
        std::vector<const char *> caps;
        const char *error;
    };
    const Row rows[] = {
        {{"zero-copy-send"}, "Zero copy only available for non-compressed non-TLS multifd migration"},
        {{"zero-copy-send", "multifd"}, ""},
        {{"zero-copy-send", "multifd", "xbzrle"}, "Zero copy only available for non-compressed non-TLS multifd migration"},
        {{"switchover-ack"}, "Capability 'switchover-ack' requires capability 'return-path'"},
        {{"switchover-ack", "return-path"}, ""},
        {{"xbzrle", "multifd"}, "Multifd is not compatible with xbzrle"},
        {{"xbzrle", "mapped-ram"}, "Mapped-ram migration is incompatible with xbzrle"},
        {{"postcopy-ram", "x-ignore-shared"}, "Postcopy is not compatible with ignore-shared"},
        {{"pause-before-switchover", "validate-uuid", "x-ignore-shared", "late-block-activate",
          "zero-blocks", "dirty-bitmaps", "postcopy-blocktime", "xbzrle"}, ""},
    };
    for (const auto &row : rows) {
        MigrationConfig c;
        json list = json::array();
        for (const char *name : row.caps) {
            list.push_back({{"capability", name}, {"state", true}});
        }
        auto e = c.set_capabilities({{"capabilities", list}});
        INFO(list.dump());
        CHECK((e ? e->desc : std::string()) == row.error);
        CHECK(c.capability(row.caps[0]) == !e);
    }
    // Zero copy also refuses compression and TLS set afterwards.
    MigrationConfig c;
    REQUIRE_FALSE(c.set_capabilities({{"capabilities", {{{"capability", "multifd"}, {"state", true}},
                                                         {{"capability", "zero-copy-send"}, {"state", true}}}}}));
    auto e = c.set_parameters({{"multifd-compression", "zstd"}});
    REQUIRE(e);
    CHECK(e->desc == "Zero copy only available for non-compressed non-TLS multifd migration");
    e = c.set_parameters({{"tls-creds", "tls0"}});
    REQUIRE(e);
    CHECK(e->desc == "Zero copy only available for non-compressed non-TLS multifd migration");
    CHECK_FALSE(c.set_parameters({{"multifd-compression", "none"}}));
}

TEST_CASE("info migrate text follows QEMU's layout", "[hmp]")
{
    json info = {{"status", "completed"}, {"total-time", 408}, {"downtime", 6},
                 {"setup-time", 1},
                 {"ram", {{"transferred", 42232832}, {"mbps", 830.154}, {"remaining", 0},
                          {"total", 67108864}, {"duplicate", 6118}, {"zero", 6118},
                          {"zero-bytes", 6118 * 4096}, {"normal", 10266},
                          {"normal-bytes", 10266 * 4096}, {"dirty-sync-count", 3},
                          {"page-size", 4096}, {"multifd-bytes", 42231808},
                          {"pages-per-second", 29440}, {"precopy-bytes", 8}}}};
    std::string s = hmp_format_info_migrate(info);
    CHECK(s.find("globals:\r\nstore-global-state: on\r\n") == 0);
    CHECK(s.find("Migration status: completed\r\ntotal time: 408 ms\r\ndowntime: 6 ms\r\n"
                 "setup: 1 ms\r\ntransferred ram: 41243 kbytes\r\nthroughput: 830.15 mbps\r\n") !=
          std::string::npos);
    CHECK(s.find("duplicate: 6118 pages\r\n") != std::string::npos);
    // zero and zero-bytes are qmigd's additions to query-migrate only: QEMU 10
    // prints no such lines.
    CHECK(s.find("duplicate: 6118 pages\r\nnormal: 10266 pages\r\n") != std::string::npos);
    CHECK(s.find("precopy ram: 0 kbytes\r\n") != std::string::npos);
    CHECK(s.find("downtime ram") == std::string::npos);
    json failed = {{"status", "failed"}, {"error-desc", "boom"}};
    CHECK(hmp_format_info_migrate(failed).find("Migration status: failed (boom)\r\ntotal time: 0 ms\r\n") !=
          std::string::npos);
}

TEST_CASE("exec-oob: only commands registered for it run out of band", "[monitor]")
{
    QmpServer server(nullptr);
    server.register_command("plain", &kQapiNoArgs,
                            [](const json &) -> QmpResult { return json::object(); });
    server.register_command(
        "fast", &kQapiNoArgs, [](const json &) -> QmpResult { return json::array(); }, true);
    QmpSession session(server);
    auto send = [&](const std::string &text) {
        auto replies = session.feed(text.data(), text.size());
        REQUIRE(replies.size() == 1);
        return replies[0];
    };
    send(R"({"execute": "qmp_capabilities", "arguments": {"enable": ["oob"]}})");
    json r = send(R"({"exec-oob": "fast", "id": 1})");
    CHECK(r["return"] == json::array());
    CHECK(r["id"] == 1);
    r = send(R"({"exec-oob": "plain"})");
    CHECK(r["error"]["desc"] == "The command plain does not support OOB");
    CHECK(send(R"({"execute": "fast"})")["return"] == json::array());
}

TEST_CASE("sizes: each of QEMU 10's own answers (tests/data/qemu-sizes.json)", "[monitor]")
{
    // The table is QEMU 10's qemu_strtosz, asked of QEMU itself
    // (tests/integration/qemu_sizes.py; test_sizes.py keeps it true).
    std::ifstream in(QMIGD_SOURCE_DIR "/tests/data/qemu-sizes.json");
    REQUIRE(in);
    json table = json::parse(in);
    REQUIRE(table.size() > 50);
    for (auto &[text, want] : table.items()) {
        auto got = qemu_strtosz(text, 0);
        INFO("size string '" << text << "'");
        if (want.is_null()) {
            CHECK_FALSE(got);
        } else {
            REQUIRE(got);
            CHECK(*got == want.get<uint64_t>());
        }
    }
    // The MiB default of HMP's max-bandwidth: a fraction needs no unit there.
    CHECK(qemu_strtosz("1.5", 20) == uint64_t(3) << 19);
    CHECK(qemu_strtosz("0x10", 20) == uint64_t(16) << 20);
}
