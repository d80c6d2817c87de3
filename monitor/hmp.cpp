// HMP commands: parsed as QEMU's, run as their QMP commands, answered as QEMU's text.
#include "monitor/hmp.h"

#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "monitor/hmp_dirty_rate.h"
#include "monitor/qapi_visit.h"
#include "monitor/qemu_size.h"

namespace qmigd {

namespace {

// An HMP value for migrate_set_parameter, converted as QEMU's HMP does, or
// the error QEMU gives for it.
QmpResult hmp_parameter_value(const json &params, const std::string &name,
                              const std::string &value)
{
    if (name == "max-postcopy-bandwidth") {
        // A plain size (visit_type_size: bytes by default, parse_option_size's errors).
        int err = 0;
        auto n = qemu_strtosz(value, 0, &err);
        if (!n && (err == ERANGE || value.find('-') != std::string::npos)) {
            return qmp_error("Value '" + value + "' is out of range for parameter '" + name + "'");
        }
        if (!n) {
            return qmp_error("Parameter '" + name + "' expects a non-negative number below 2^64"
                             "\r\nOptional suffix k, M, G, T, P or E means kilo-, mega-, giga-, "
                             "tera-, peta-\r\nand exabytes, respectively.");
        }
        return json(*n);
    }
    if (name == "max-bandwidth" || name == "avail-switchover-bandwidth") {
        auto n = qemu_strtosz(value, 20);
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

// One HMP command as QEMU's hmp-commands.hx has it: the help line is
// "<names> <params> -- <help>", and the arguments are `flags` (single-letter
// options such as -d), then `strings` words, then an on/off word if
// `boolean`.
struct HmpCall {
    QmpServer &server;
    const HmpUriCheck &uri_check;
    std::vector<std::string> args;
    std::string flags; // the option letters given
};

struct HmpCommand {
    const char *names; // "stop|s": the name, then aliases
    const char *params;
    const char *help;
    const char *flags;
    int strings;
    bool boolean;
    std::string (*run)(const HmpCall &);
    // After the flags, the rest of the words go to run() unparsed (its
    // arguments are expressions: calc_dirty_rate).
    bool rest = false;
};

QmpResult query(QmpServer &server, const char *name)
{
    return server.dispatch(name, json::object());
}

std::string simple(const HmpCall &c, const char *qmp_name, json args = json::object())
{
    return error_text(c.server.dispatch(qmp_name, args));
}

// hmp_migrate_continue(): qapi_enum_parse() words an unknown state its own way.
std::string migrate_continue(const HmpCall &c)
{
    QmpResult r = c.server.dispatch("migrate-continue", {{"state", c.args[0]}});
    auto *e = std::get_if<QmpError>(&r);
    if (e && e->desc.rfind("Parameter 'state' does not accept", 0) == 0) {
        return "Error: invalid parameter value: " + c.args[0] + "\r\n";
    }
    return error_text(r);
}

// "string expected" and its kin, as QEMU's monitor_parse_arguments words them.
std::string usage_error(const std::string &name, const std::string &help_topic,
                        const std::string &what)
{
    return name + ": " + what + "\r\nTry \"help " + help_topic + "\" for more information\r\n";
}

// Whether query-migrate-capabilities lists capability `name`.
bool known_capability(const json &caps, const std::string &name)
{
    for (const auto &c : caps) {
        if (c.value("capability", "") == name) {
            return true;
        }
    }
    return false;
}

std::string set_parameter(const HmpCall &c)
{
    const std::string &name = c.args[0], &value = c.args[1];
    json params = std::get<json>(query(c.server, "query-migrate-parameters"));
    if (!params.contains(name)) {
        return "Error: invalid parameter value: " + name + "\r\n";
    }
    QmpResult v = hmp_parameter_value(params, name, value);
    if (std::holds_alternative<QmpError>(v)) {
        return error_text(v);
    }
    return simple(c, "migrate-set-parameters", {{name, std::get<json>(v)}});
}

std::string set_capability(const HmpCall &c)
{
    json caps = std::get<json>(query(c.server, "query-migrate-capabilities"));
    if (!known_capability(caps, c.args[0])) {
        return "Error: invalid parameter value: " + c.args[0] + "\r\n";
    }
    json one = {{"capability", c.args[0]}, {"state", c.args[1] == "on"}};
    return simple(c, "migrate-set-capabilities", {{"capabilities", json::array({one})}});
}

std::string migrate(const HmpCall &c)
{
    json args = {{"uri", c.args[0]}};
    if (c.flags.find('r') != std::string::npos) {
        args["resume"] = true;
    }
    std::string out = simple(c, "migrate", args);
    if (!out.empty() || c.flags.find('d') != std::string::npos) {
        return out;
    }
    // QEMU waits for the end by suspending the monitor, which a QMP
    // human-monitor-command cannot do.
    return "terminal does not allow synchronous migration, continuing detached\r\n";
}

// QEMU's hmp_migrate_incoming parses the URI into a channel before
// qmp_migrate_incoming checks anything: a bad URI is the first error.
std::string migrate_incoming(const HmpCall &c)
{
    if (c.uri_check) {
        if (auto e = c.uri_check(c.args[0])) {
            return "Error: " + *e + "\r\n";
        }
    }
    return simple(c, "migrate-incoming", {{"uri", c.args[0]}});
}

std::string calc_dirty_rate(const HmpCall &c)
{
    std::string rest;
    for (const auto &w : c.args) {
        rest += (rest.empty() ? "" : " ") + w;
    }
    return hmp_calc_dirty_rate(c.server, c.flags.find('r') != std::string::npos,
                               c.flags.find('b') != std::string::npos, rest, "calc_dirty_rate");
}

using Formatter = std::string (*)(const json &);
std::string info_of(const HmpCall &c, const char *qmp_name, Formatter f)
{
    QmpResult r = query(c.server, qmp_name);
    return std::holds_alternative<QmpError>(r) ? error_text(r) : f(std::get<json>(r));
}

const HmpCommand kInfoCommands[] = {
    {"dirty_rate", "", "show dirty rate information", "", 0, false,
     [](const HmpCall &c) { return info_of(c, "query-dirty-rate", hmp_format_info_dirty_rate); }},
    {"migrate", "", "show migration status", "", 0, false,
     [](const HmpCall &c) { return info_of(c, "query-migrate", hmp_format_info_migrate); }},
    {"migrate_capabilities", "", "show current migration capabilities", "", 0, false,
     [](const HmpCall &c) {
         return info_of(c, "query-migrate-capabilities", hmp_format_info_migrate_capabilities);
     }},
    {"migrate_parameters", "", "show current migration parameters", "", 0, false,
     [](const HmpCall &c) {
         return info_of(c, "query-migrate-parameters", hmp_format_info_migrate_parameters);
     }},
    {"status", "", "show the current VM status (running|paused)", "", 0, false,
     [](const HmpCall &c) { return info_of(c, "query-status", hmp_format_info_status); }},
    {"version", "", "show the version of QEMU", "", 0, false,
     [](const HmpCall &c) { return info_of(c, "query-version", hmp_format_info_version); }},
};

std::string run_info(const HmpCall &c);
std::string run_help(const HmpCall &c);

// Sorted by name, as QEMU lists them.
const HmpCommand kCommands[] = {
    {"calc_dirty_rate", "[-r] [-b] second [sample_pages_per_GB]",
     "start a round of guest dirty rate measurement (using -r to\r\n\t\t\t specify dirty ring "
     "as the method of calculation and\r\n\t\t\t -b to specify dirty bitmap as method of "
     "calculation)",
     "rb", 0, false, calc_dirty_rate, true},
    {"cont|c", "", "resume emulation", "", 0, false,
     [](const HmpCall &c) { return simple(c, "cont"); }},
    {"help|?", "[cmd]", "show the help", "", -1, false, run_help},
    {"info", "[subcommand]", "show various information about the system state", "", -1, false,
     run_info},
    {"migrate", "[-d] [-r] uri",
     "migrate to URI (using -d to not wait for completion)\r\n\t\t\t -r to resume a paused "
     "postcopy migration",
     "dr", 1, false, migrate},
    {"migrate_cancel", "", "cancel the current VM migration", "", 0, false,
     [](const HmpCall &c) { return simple(c, "migrate_cancel"); }},
    {"migrate_continue", "state", "Continue migration from the given paused state", "", 1,
     false, migrate_continue},
    {"migrate_incoming", "uri", "Continue an incoming migration from an -incoming defer", "", 1,
     false, migrate_incoming},
    {"migrate_pause", "", "Pause an ongoing migration (postcopy-only)", "", 0, false,
     [](const HmpCall &c) { return simple(c, "migrate-pause"); }},
    {"migrate_recover", "uri", "Continue a paused incoming postcopy migration", "", 1, false,
     [](const HmpCall &c) { return simple(c, "migrate-recover", {{"uri", c.args[0]}}); }},
    {"migrate_set_capability", "capability state",
     "Enable/Disable the usage of a capability for migration", "", 1, true, set_capability},
    {"migrate_set_parameter", "parameter value", "Set the parameter for migration", "", 2, false,
     set_parameter},
    {"migrate_start_postcopy", "",
     "Followup to a migration command to switch the migration to postcopy mode. The "
     "postcopy-ram capability must be set on both source and destination before the original "
     "migration command .",
     "", 0, false, [](const HmpCall &c) { return simple(c, "migrate-start-postcopy"); }},
    {"quit|q", "", "quit the emulator", "", 0, false,
     [](const HmpCall &c) { return simple(c, "quit"); }},
    {"stop|s", "", "stop emulation", "", 0, false,
     [](const HmpCall &c) { return simple(c, "stop"); }},
};

template <size_t N>
const HmpCommand *find_command(const HmpCommand (&table)[N], const std::string &name)
{
    for (const auto &cmd : table) {
        std::istringstream names(cmd.names);
        for (std::string alias; std::getline(names, alias, '|');) {
            if (alias == name) {
                return &cmd;
            }
        }
    }
    return nullptr;
}

std::string help_line(const HmpCommand &cmd, const char *prefix = "")
{
    return std::string(prefix) + cmd.names + " " + cmd.params + " -- " + cmd.help + "\r\n";
}

template <size_t N>
std::string help_list(const HmpCommand (&table)[N], const char *prefix)
{
    std::string s;
    for (const auto &cmd : table) {
        s += help_line(cmd, prefix);
    }
    return s;
}

std::vector<std::string> words(const std::string &line)
{
    std::istringstream in(line);
    std::vector<std::string> w;
    for (std::string t; in >> t;) {
        w.push_back(t);
    }
    return w;
}

// Parses the words after the command name against cmd's arguments and runs
// it. `topic` is what "Try \"help ...\"" names.
std::string invoke(const HmpCommand &cmd, QmpServer &server, const HmpUriCheck &uri_check,
                   std::vector<std::string> w, const std::string &topic)
{
    std::string name = cmd.names;
    HmpCall call{server, uri_check, {}, ""};
    if (cmd.strings < 0) { // takes any words
        call.args = std::move(w);
        return cmd.run(call);
    }
    size_t i = 0;
    // monitor_parse_arguments: each flag in turn looks at the next word; its
    // own letter takes "-X" off it, a later flag's letter leaves it, anything
    // else is refused. What is left ("-rd" leaves "d") is the next argument.
    for (const char *f = cmd.flags; *f; f++) {
        if (i >= w.size() || w[i].size() < 2 || w[i][0] != '-') {
            continue;
        }
        char seen = w[i][1];
        if (seen == *f) {
            call.flags += *f;
            w[i].erase(0, 2);
            i += w[i].empty() ? 1 : 0;
        } else if (!std::strchr(f + 1, seen)) {
            return usage_error(name, topic, std::string("unsupported option -") + seen);
        }
    }
    if (cmd.rest) {
        call.args.assign(w.begin() + long(i), w.end());
        return cmd.run(call);
    }
    for (int k = 0; k < cmd.strings; k++, i++) {
        if (i >= w.size()) {
            return usage_error(name, topic, "string expected");
        }
        call.args.push_back(w[i]);
    }
    if (cmd.boolean) {
        if (i >= w.size() || (w[i] != "on" && w[i] != "off")) {
            // QEMU prints this one without the command's name in front.
            return "Expected 'on' or 'off'\r\nTry \"help " + topic + "\" for more information\r\n";
        }
        call.args.push_back(w[i++]);
    }
    if (i < w.size()) {
        return usage_error(name, topic, "extraneous characters at the end of line");
    }
    return cmd.run(call);
}

std::string run_info(const HmpCall &c)
{
    if (c.args.empty()) {
        return help_list(kInfoCommands, "info ");
    }
    const HmpCommand *sub = find_command(kInfoCommands, c.args[0]);
    if (!sub) {
        return "unknown command: 'info " + c.args[0] + "'\r\n";
    }
    return invoke(*sub, c.server, c.uri_check, {c.args.begin() + 1, c.args.end()},
                  "info " + c.args[0]);
}

std::string run_help(const HmpCall &c)
{
    if (c.args.empty()) {
        return help_list(kCommands, "");
    }
    if (c.args[0] == "info") {
        if (c.args.size() == 1) {
            return help_list(kInfoCommands, "info ");
        }
        const HmpCommand *sub = find_command(kInfoCommands, c.args[1]);
        return sub ? help_line(*sub, "info ") : "unknown command: 'info " + c.args[1] + "'\r\n";
    }
    const HmpCommand *cmd = find_command(kCommands, c.args[0]);
    return cmd ? help_line(*cmd) : "unknown command: '" + c.args[0] + "'\r\n";
}

std::string run_hmp(QmpServer &server, const HmpUriCheck &uri_check, const std::string &line)
{
    std::vector<std::string> w = words(line);
    if (w.empty()) {
        return "";
    }
    const HmpCommand *cmd = find_command(kCommands, w[0]);
    if (!cmd) {
        return "unknown command: '" + w[0] + "'\r\n";
    }
    return invoke(*cmd, server, uri_check, {w.begin() + 1, w.end()}, w[0]);
}
// human-monitor-command's arguments (qapi/misc.json).
const QapiType kHmpArgs = qapi_struct({{"command-line", &kQapiStr}, {"cpu-index", &kQapiInt, true}});

} // namespace

void hmp_register(QmpServer &server, HmpUriCheck uri_check)
{
    server.register_command("human-monitor-command", &kHmpArgs,
                            [&server, uri_check](const json &args) -> QmpResult {
        // A daemon has no CPUs: QEMU 10 with -M none answers any cpu-index so.
        if (args.contains("cpu-index")) {
            return qmp_error("Parameter 'cpu-index' expects a CPU number");
        }
        return json(run_hmp(server, uri_check, args["command-line"]));
    });
}

} // namespace qmigd
