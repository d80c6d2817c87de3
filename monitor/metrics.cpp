// The Prometheus text of a daemon's migration counters.
#include "monitor/metrics.h"

#include <fmt/format.h>

namespace qmigd {

namespace {

using nlohmann::json;

// QAPI's MigrationStatus values: one series each, 1 for the current one.
const char *const kStatuses[] = {"none",           "setup",          "cancelling",
                                 "cancelled",      "active",         "postcopy-active",
                                 "postcopy-paused", "postcopy-recover-setup",
                                 "postcopy-recover", "completed",     "failed",
                                 "colo",           "pre-switchover", "device",
                                 "wait-unplug"};

class Writer {
public:
    // # HELP and # TYPE once per family, then its samples.
    void family(const char *name, const char *type, const char *help)
    {
        out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    }
    void sample(const char *name, double v, const std::string &labels = "")
    {
        out_ += labels.empty() ? fmt::format("{} {}\n", name, v)
                               : fmt::format("{}{{{}}} {}\n", name, labels, v);
    }
    std::string take() { return std::move(out_); }

private:
    std::string out_;
};

// Label values: backslash, quote and newline escaped.
std::string label(const std::string &v)
{
    std::string out;
    for (char c : v) {
        if (c == '\\' || c == '"') {
            out += '\\';
        }
        out += c == '\n' ? std::string("\\n") : std::string(1, c);
    }
    return out;
}

double num(const json &j, const char *key)
{
    auto it = j.find(key);
    return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

// One migration's figures (the current one, or the last finished with
// prefix qmigd_last_migration), from its query-migrate.
void migration(Writer &w, const std::string &prefix, const json &q, bool with_status)
{
    auto name = [&](const char *suffix) { return prefix + suffix; };
    std::string status = q.value("status", "none");
    if (with_status) {
        std::string n = name("_status");
        w.family(n.c_str(), "gauge", "1 for the migration's status (QAPI MigrationStatus)");
        for (const char *s : kStatuses) {
            w.sample(n.c_str(), status == s ? 1 : 0, fmt::format("status=\"{}\"", s));
        }
    }
    const json ram = q.value("ram", json::object());
    const json in = q.value("incoming", json::object());
    struct Counter {
        const char *suffix, *help;
        double value;
        const char *type = "counter";
    };
    const Counter list[] = {
        {"_transferred_bytes_total", "bytes sent (source) or received (destination)",
         ram.empty() ? num(in, "bytes") : num(ram, "transferred")},
        {"_normal_pages_total", "pages sent (source) or received (destination) whole",
         ram.empty() ? num(in, "normal") : num(ram, "normal")},
        {"_zero_pages_total", "zero pages sent or received", ram.empty() ? num(in, "zero") : num(ram, "zero")},
        {"_multifd_bytes_total", "bytes sent on the multifd channels", num(ram, "multifd-bytes")},
        {"_precopy_bytes_total", "bytes sent before the switchover", num(ram, "precopy-bytes")},
        {"_downtime_bytes_total", "bytes sent with the VM stopped", num(ram, "downtime-bytes")},
        {"_postcopy_bytes_total", "bytes sent in postcopy", num(ram, "postcopy-bytes")},
        {"_postcopy_requests_total", "pages the destination asked for", num(ram, "postcopy-requests")},
        {"_dirty_syncs_total", "dirty bitmap syncs", num(ram, "dirty-sync-count")},
        {"_remaining_bytes", "RAM still to send", num(ram, "remaining"), "gauge"},
        {"_ram_bytes", "RAM the migration covers", num(ram, "total"), "gauge"},
        {"_dirty_pages_per_second", "pages the guest dirties a second", num(ram, "dirty-pages-rate"), "gauge"},
        {"_throughput_bytes_per_second", "bytes sent a second, on average",
         num(ram, "mbps") * 1e6 / 8, "gauge"},
        {"_setup_seconds", "time to the first page", num(q, "setup-time") / 1000, "gauge"},
        {"_total_seconds", "time since the start, or of the whole migration once ended",
         num(q, "total-time") / 1000, "gauge"},
        {"_downtime_seconds", "time the VM was stopped (once known)", num(q, "downtime") / 1000, "gauge"},
        {"_expected_downtime_seconds", "what stopping now would cost", num(q, "expected-downtime") / 1000, "gauge"},
        {"_cpu_throttle_ratio", "how much auto-converge slows the guest (0..1)",
         num(q, "cpu-throttle-percentage") / 100, "gauge"},
    };
    for (const auto &c : list) {
        std::string n = name(c.suffix);
        w.family(n.c_str(), c.type, c.help);
        w.sample(n.c_str(), c.value);
    }
}

} // namespace

std::string prometheus_metrics(const MetricsInput &in)
{
    Writer w;
    w.family("qmigd_info", "gauge", "the daemon's role and version");
    w.sample("qmigd_info", 1,
             fmt::format("role=\"{}\",version=\"{}\"", label(in.role), label(in.version)));
    w.family("qmigd_page_path_info", "gauge", "the page path each RAM block uses");
    for (const auto &[block, path] : in.page_paths) {
        w.sample("qmigd_page_path_info", 1,
                 fmt::format("block=\"{}\",path=\"{}\"", label(block), label(path)));
    }
    migration(w, "qmigd_migration", in.current, true);
    w.family("qmigd_last_migration_end_timestamp_seconds", "gauge",
             "when the last migration ended (0: none has)");
    w.sample("qmigd_last_migration_end_timestamp_seconds", in.last_end_unix);
    if (!in.last.empty()) {
        migration(w, "qmigd_last_migration", in.last, true);
    }
    w.family("qmigd_process_resident_memory_bytes", "gauge", "the daemon's resident memory");
    w.sample("qmigd_process_resident_memory_bytes", double(in.resident_bytes));
    w.family("qmigd_process_threads", "gauge", "the daemon's threads");
    w.sample("qmigd_process_threads", double(in.threads));
    w.family("qmigd_process_cpu_seconds_total", "counter", "the daemon's CPU time, all threads");
    w.sample("qmigd_process_cpu_seconds_total", in.cpu_seconds);
    return w.take();
}

} // namespace qmigd
