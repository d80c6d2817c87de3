#include "monitor/hmp.h"

#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <sstream>

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
    s += fmt::format("zero: {} pages\r\n", u(ram, "zero"));
    s += fmt::format("zero bytes: {} kbytes\r\n", u(ram, "zero-bytes") >> 10);
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
    if (u(ram, "precopy-bytes")) {
        s += fmt::format("precopy ram: {} kbytes\r\n", u(ram, "precopy-bytes") >> 10);
    }
    if (u(ram, "downtime-bytes")) {
        s += fmt::format("downtime ram: {} kbytes\r\n", u(ram, "downtime-bytes") >> 10);
    }
    if (u(ram, "postcopy-bytes")) {
        s += fmt::format("postcopy ram: {} kbytes\r\n", u(ram, "postcopy-bytes") >> 10);
    }
}

// QEMU's qemu_strtosz_MiB(): decimal digits with an optional fraction, or
// 0x hex digits; then an optional unit B K M G T P E (any case; none means
// MiB) and nothing else. No sign, exponent, inf or nan; overflow is an error.
std::optional<uint64_t> parse_size_mib(const std::string &text)
{
    size_t i = 0;
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) {
        i++;
    }
    bool hex = text.compare(i, 2, "0x") == 0 || text.compare(i, 2, "0X") == 0;
    i += hex ? 2 : 0;
    uint64_t whole = 0;
    size_t digits = 0;
    for (; i < text.size() && std::isxdigit(static_cast<unsigned char>(text[i])); i++, digits++) {
        int d = std::isdigit(static_cast<unsigned char>(text[i])) ? text[i] - '0'
                                                                  : (std::tolower(text[i]) - 'a' + 10);
        if (!hex && d > 9) {
            break;
        }
        unsigned base = hex ? 16 : 10;
        if (whole > (UINT64_MAX - unsigned(d)) / base) {
            return std::nullopt;
        }
        whole = whole * base + unsigned(d);
    }
    if (digits == 0) {
        return std::nullopt;
    }
    double fraction = 0;
    if (!hex && i < text.size() && text[i] == '.') {
        double scale = 0.1;
        for (i++; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); i++) {
            fraction += (text[i] - '0') * scale;
            scale /= 10;
        }
    }
    static const std::string units = "bkmgtpe";
    unsigned shift = 20;
    if (i < text.size()) {
        size_t u = units.find(char(std::tolower(static_cast<unsigned char>(text[i]))));
        if (u == std::string::npos || i + 1 != text.size()) {
            return std::nullopt;
        }
        shift = unsigned(u) * 10;
    }
    uint64_t mul = uint64_t(1) << shift;
    if (mul == 1 && fraction != 0) {
        return std::nullopt;
    }
    uint64_t frac = uint64_t(fraction * double(mul));
    if (whole > (UINT64_MAX - frac) / mul) {
        return std::nullopt;
    }
    return whole * mul + frac;
}

// An HMP value for migrate_set_parameter, converted as QEMU's HMP does, or
// the error QEMU gives for it.
QmpResult hmp_parameter_value(const json &params, const std::string &name,
                              const std::string &value)
{
    if (name == "max-bandwidth" || name == "avail-switchover-bandwidth" ||
        name == "max-postcopy-bandwidth") {
        auto n = parse_size_mib(value);
        if (!n || *n > uint64_t(INT64_MAX)) {
            return qmp_error("Invalid size " + value);
        }
        return json(*n);
    }
    if (params.contains(name) && params[name].is_number()) {
        // The string input visitor: any integer, negatives wrapping.
        char *end = nullptr;
        errno = 0;
        long long n = std::strtoll(value.c_str(), &end, 0);
        if (value.empty() || *end != '\0' || errno == ERANGE) {
            unsigned long long u = std::strtoull(value.c_str(), &end, 0);
            if (value.empty() || *end != '\0' || value[0] == '-') {
                return qmp_error("Parameter '" + name + "' expects uint64");
            }
            return json(uint64_t(u));
        }
        return json(uint64_t(n));
    }
    if (params.contains(name) && params[name].is_boolean()) {
        return json(value == "on" || value == "true");
    }
    return json(value);
}

std::string error_text(const QmpResult &r)
{
    if (auto *e = std::get_if<QmpError>(&r)) {
        return "Error: " + e->desc + "\r\n";
    }
    return "";
}

std::string run_hmp(QmpServer &server, const std::string &line)
{
    std::istringstream in(line);
    std::string cmd, a, b;
    in >> cmd >> a >> b;
    if (cmd == "info" && a == "migrate") {
        auto r = server.dispatch("query-migrate", json::object());
        return error_text(r) + hmp_format_info_migrate(std::get<json>(r));
    }
    if (cmd == "info" && a == "migrate_parameters") {
        auto r = server.dispatch("query-migrate-parameters", json::object());
        return hmp_format_info_migrate_parameters(std::get<json>(r));
    }
    if (cmd == "info" && a == "migrate_capabilities") {
        auto r = server.dispatch("query-migrate-capabilities", json::object());
        return hmp_format_info_migrate_capabilities(std::get<json>(r));
    }
    if (cmd == "migrate_set_parameter" && !a.empty()) {
        if (b.empty()) {
            return "migrate_set_parameter: string expected\r\nTry \"help migrate_set_parameter\" "
                   "for more information\r\n";
        }
        auto params = std::get<json>(server.dispatch("query-migrate-parameters", json::object()));
        QmpResult v = hmp_parameter_value(params, a, b);
        if (std::holds_alternative<QmpError>(v)) {
            return error_text(v);
        }
        json args = {{a, std::get<json>(v)}};
        return error_text(server.dispatch("migrate-set-parameters", args));
    }
    if (cmd == "migrate_set_capability" && !a.empty() && (b == "on" || b == "off")) {
        json args = {{"capabilities", json::array({{{"capability", a}, {"state", b == "on"}}})}};
        return error_text(server.dispatch("migrate-set-capabilities", args));
    }
    if (cmd == "migrate_cancel") {
        return error_text(server.dispatch("migrate_cancel", json::object()));
    }
    if (cmd == "stop" || cmd == "cont" || cmd == "quit") {
        return error_text(server.dispatch(cmd, json::object()));
    }
    return "unknown command: '" + line + "'\r\n";
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
    if (info.contains("incoming")) {
        const json &in = info["incoming"];
        s += fmt::format("received normal: {} pages\r\n", u(in, "normal"));
        s += fmt::format("received zero: {} pages\r\n", u(in, "zero"));
        s += fmt::format("received bytes: {} kbytes\r\n", u(in, "bytes") >> 10);
    }
    if (info.contains("socket-address")) {
        s += "socket address: [\r\n";
        for (const auto &a : info["socket-address"]) {
            s += "\ttcp:" + a.value("host", "") + ":" + a.value("port", "") + "\r\n";
        }
        s += "]\r\n";
    }
    return s;
}

std::string hmp_format_info_migrate_parameters(const json &p)
{
    std::string s;
    for (auto it = p.begin(); it != p.end(); ++it) {
        std::string v = it->is_string() ? it->get<std::string>() : it->dump();
        if (it->is_boolean()) {
            v = it->get<bool>() ? "on" : "off";
        }
        std::string unit = it.key() == "max-bandwidth" || it.key() == "avail-switchover-bandwidth" ||
                                   it.key() == "max-postcopy-bandwidth"
                               ? " bytes/second"
                           : it.key() == "downtime-limit" || it.key() == "x-checkpoint-delay"
                               ? " ms"
                           : it.key() == "xbzrle-cache-size" ? " bytes"
                                                             : "";
        s += it.key() + ": " + v + unit + "\r\n";
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

void hmp_register(QmpServer &server)
{
    server.register_command("human-monitor-command", {{"command-line", "cpu-index"}},
                            [&server](const json &args) -> QmpResult {
        if (!args.contains("command-line")) {
            return qmp_error("Parameter 'command-line' is missing");
        }
        if (!args["command-line"].is_string()) {
            return qmp_error("Invalid parameter type for 'command-line', expected: string");
        }
        return json(run_hmp(server, args["command-line"]));
    });
}

} // namespace qmigd
