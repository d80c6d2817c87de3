// The Prometheus text exposition (format 0.0.4) of a daemon's migration
// figures: built from what query-migrate says now, and from the last
// finished migration's query-migrate, kept until the next one starts (a
// scrape that comes after the end still sees its totals and outcome).
// Names follow Prometheus' conventions: qmigd_ prefix, base units
// (_bytes, _seconds), _total for counters. A migration's counters start
// from 0 with each migration, which Prometheus reads as a counter reset.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace qmigd {

struct MetricsInput {
    std::string role;           // "source" | "destination"
    std::string version;
    nlohmann::json current;     // query-migrate now ({} before any)
    nlohmann::json last;        // query-migrate at the last end ({} if none)
    double last_end_unix = 0;   // when it ended (seconds since the epoch)
    // The page path each RAM block uses (ramstate/page_path.h): block, path.
    std::vector<std::pair<std::string, std::string>> page_paths;
    // The daemon itself (/proc/self).
    uint64_t resident_bytes = 0;
    uint64_t threads = 0;
    double cpu_seconds = 0;
};

std::string prometheus_metrics(const MetricsInput &in);

} // namespace qmigd
