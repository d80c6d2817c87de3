// The text of HMP's `info` commands, built from QMP results in QEMU 10's
// layout and units (migration-hmp-cmds.c, qmp-cmds.c).
#include "monitor/hmp.h"

#include <fmt/format.h>

namespace qmigd {

namespace {

constexpr const char *kGlobals = "globals:\r\n"
                                 "store-global-state: on\r\n"
                                 "only-migratable: off\r\n"
                                 "send-configuration: on\r\n"
                                 "send-section-footer: on\r\n"
                                 "send-switchover-start: on\r\n"
                                 "clear-bitmap-shift: 18\r\n";

uint64_t u(const json &o, const char *k) { return o.value(k, uint64_t(0)); }

void ram_lines(std::string &s, const json &ram)
{
    s += fmt::format("transferred ram: {} kbytes\r\n", u(ram, "transferred") >> 10);
    s += fmt::format("throughput: {:.2f} mbps\r\n", ram.value("mbps", 0.0));
    s += fmt::format("remaining ram: {} kbytes\r\n", u(ram, "remaining") >> 10);
    s += fmt::format("total ram: {} kbytes\r\n", u(ram, "total") >> 10);
    s += fmt::format("duplicate: {} pages\r\n", u(ram, "duplicate"));
    s += fmt::format("normal: {} pages\r\n", u(ram, "normal"));
    s += fmt::format("normal bytes: {} kbytes\r\n", u(ram, "normal-bytes") >> 10);
    s += fmt::format("dirty sync count: {}\r\n", u(ram, "dirty-sync-count"));
    s += fmt::format("page size: {} kbytes\r\n", u(ram, "page-size") >> 10);
    s += fmt::format("multifd bytes: {} kbytes\r\n", u(ram, "multifd-bytes") >> 10);
    s += fmt::format("pages-per-second: {}\r\n", u(ram, "pages-per-second"));
    if (u(ram, "dirty-pages-rate")) {
        s += fmt::format("dirty pages rate: {} pages\r\n", u(ram, "dirty-pages-rate"));
    }
    if (u(ram, "postcopy-requests")) {
        s += fmt::format("postcopy request count: {}\r\n", u(ram, "postcopy-requests"));
    }
    if (ram.contains("x-working-set-pages")) { // qmigd's, on a parked VM's postcopy resume
        s += fmt::format("working set sent: {} pages, then requested: {} pages\r\n",
                         u(ram, "x-working-set-pages"), u(ram, "x-working-set-requested"));
    }
    if (u(ram, "precopy-bytes")) {
        s += fmt::format("precopy ram: {} kbytes\r\n", u(ram, "precopy-bytes") >> 10);
    }
    if (u(ram, "downtime-bytes")) {
        s += fmt::format("downtime ram: {} kbytes\r\n", u(ram, "downtime-bytes") >> 10);
    }
    if (u(ram, "postcopy-bytes")) {
        s += fmt::format("postcopy ram: {} kbytes\r\n", u(ram, "postcopy-bytes") >> 10);
    }
    if (u(ram, "dirty-sync-missed-zero-copy")) {
        s += fmt::format("Zero-copy-send fallbacks happened: {} times\r\n",
                         u(ram, "dirty-sync-missed-zero-copy"));
    }
}

void xbzrle_lines(std::string &s, const json &x)
{
    s += fmt::format("cache size: {} bytes\r\n", u(x, "cache-size"));
    s += fmt::format("xbzrle transferred: {} kbytes\r\n", u(x, "bytes") >> 10);
    s += fmt::format("xbzrle pages: {} pages\r\n", u(x, "pages"));
    s += fmt::format("xbzrle cache miss: {} pages\r\n", u(x, "cache-miss"));
    s += fmt::format("xbzrle cache miss rate: {:.2f}\r\n", x.value("cache-miss-rate", 0.0));
    s += fmt::format("xbzrle encoding rate: {:.2f}\r\n", x.value("encoding-rate", 0.0));
    s += fmt::format("xbzrle overflow: {}\r\n", u(x, "overflow"));
}

} // namespace

std::string hmp_format_info_migrate(const json &info)
{
    std::string s = kGlobals;
    if (!info.contains("status")) {
        return s;
    }
    std::string status = info["status"];
    s += "Migration status: " + status;
    if (status == "failed" && info.contains("error-desc")) {
        s += " (" + info["error-desc"].get<std::string>() + ")";
    }
    s += "\r\n";
    s += fmt::format("total time: {} ms\r\n", u(info, "total-time"));
    if (info.contains("expected-downtime")) {
        s += fmt::format("expected downtime: {} ms\r\n", u(info, "expected-downtime"));
    }
    if (info.contains("downtime")) {
        s += fmt::format("downtime: {} ms\r\n", u(info, "downtime"));
    }
    if (info.contains("setup-time")) {
        s += fmt::format("setup: {} ms\r\n", u(info, "setup-time"));
    }
    if (info.contains("ram")) {
        ram_lines(s, info["ram"]);
    }
    if (info.contains("xbzrle-cache")) {
        xbzrle_lines(s, info["xbzrle-cache"]);
    }
    if (info.contains("incoming")) {
        const json &in = info["incoming"];
        s += fmt::format("received normal: {} pages\r\n", u(in, "normal"));
        s += fmt::format("received zero: {} pages\r\n", u(in, "zero"));
        s += fmt::format("received bytes: {} kbytes\r\n", u(in, "bytes") >> 10);
    }
    if (info.contains("parked")) { // a parked VM (qmigd dest --ram-dir)
        const json &pk = info["parked"];
        s += fmt::format("parked in: {} ({})\r\n", pk.value("dir", ""),
                         pk.value("machine-type", ""));
        for (const auto &b : pk["blocks"]) {
            s += fmt::format("parked block: {} {} kbytes\r\n", b.value("id", ""),
                             u(b, "size") >> 10);
        }
        s += fmt::format("parked device state: {} bytes\r\n", u(pk, "device-state-bytes"));
    }
    if (info.contains("socket-address")) {
        s += "socket address: [\r\n";
        for (const auto &a : info["socket-address"]) {
            // QEMU's socket_uri()
            s += a.value("type", "") == "unix"
                     ? "\tunix:" + a.value("path", "") + "\r\n"
                     : "\ttcp:" + a.value("host", "") + ":" + a.value("port", "") + "\r\n";
        }
        s += "]\r\n";
    }
    return s;
}

// QEMU 10's hmp_info_migrate_parameters: its order, its units, strings in
// quotes; the compression levels are not printed.
std::string hmp_format_info_migrate_parameters(const json &p)
{
    static const struct {
        const char *name;
        const char *format; // {} is the value
    } lines[] = {
        {"announce-initial", "{} ms"},
        {"announce-max", "{} ms"},
        {"announce-rounds", "{}"},
        {"announce-step", "{} ms"},
        {"throttle-trigger-threshold", "{}"},
        {"cpu-throttle-initial", "{}"},
        {"cpu-throttle-increment", "{}"},
        {"cpu-throttle-tailslow", "{}"},
        {"max-cpu-throttle", "{}"},
        {"tls-creds", "'{}'"},
        {"tls-hostname", "'{}'"},
        {"max-bandwidth", "{} bytes/second"},
        {"avail-switchover-bandwidth", "{} bytes/second"},
        {"downtime-limit", "{} ms"},
        {"x-checkpoint-delay", "{} ms"},
        {"multifd-channels", "{}"},
        {"multifd-compression", "{}"},
        {"zero-page-detection", "{}"},
        {"xbzrle-cache-size", "{} bytes"},
        {"max-postcopy-bandwidth", "{}"},
        {"tls-authz", "'{}'"},
        {"x-vcpu-dirty-limit-period", "{} ms"},
        {"vcpu-dirty-limit", "{} MB/s"},
        {"mode", "{}"},
        {"direct-io", "{}"},
    };
    std::string s;
    for (const auto &l : lines) {
        if (!p.contains(l.name)) {
            continue;
        }
        const json &v = p[l.name];
        std::string text = v.is_string()    ? v.get<std::string>()
                           : v.is_boolean() ? (v.get<bool>() ? "on" : "off")
                                            : v.dump();
        s += std::string(l.name) + ": " + fmt::format(fmt::runtime(l.format), text) + "\r\n";
    }
    return s;
}

std::string hmp_format_info_migrate_capabilities(const json &caps)
{
    std::string s;
    for (const auto &c : caps) {
        s += c["capability"].get<std::string>() + ": " + (c["state"].get<bool>() ? "on" : "off") +
             "\r\n";
    }
    return s;
}

std::string hmp_format_info_status(const json &status)
{
    std::string s = status.value("status", "");
    std::string line = std::string("VM status: ") + (status.value("running", false) ? "running" : "paused");
    if (!status.value("running", false) && s != "paused") {
        line += " (" + s + ")";
    }
    return line + "\r\n";
}

std::string hmp_format_info_version(const json &version)
{
    const json &q = version["qemu"];
    return fmt::format("{}.{}.{}{}\r\n", q.value("major", 0), q.value("minor", 0),
                       q.value("micro", 0), version.value("package", ""));
}

} // namespace qmigd
