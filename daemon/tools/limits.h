// `qmigd limits`: this machine's costs that bound a migration, measured in a
// few seconds, so that a benchmark can state each result as a share of what
// the machine can do (scripts/bench.py --limits).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace qmigd {

// Measures in `dir` (a file system like the guest's): zero scan, memcpy,
// first write into a fresh shared mapping, pwrite into a fresh file, and
// loopback TCP with 4 streams; plus the page-path costs of that directory.
// With idle_s > 0, also the first write into memory left unused for that
// long (fault_idle_ns_per_page; -1 when idle_s is 0).
nlohmann::json measure_limits(const std::string &dir, unsigned idle_s);

// Only the first touch of `bytes` of fresh memory in `dir`, from one thread
// per core (`qmigd limits --fault-bytes`): what a destination that receives
// that much page data pays to allocate it, which on a paravirtualised host
// grows with the size (scripts/bench.py runs it beside each cell).
nlohmann::json measure_fault_scale(const std::string &dir, size_t bytes);

} // namespace qmigd
