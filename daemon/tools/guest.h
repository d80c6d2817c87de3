// `qmigd guest`: a stand-in for a vCPU that dirties guest RAM at a steady
// rate through the shared mapping, marking each page in the dirty bitmap
// after writing it, and obeying the guest control record (pause, throttle).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "protocol/error.h"

namespace qmigd {

enum class GuestPattern { Random, Sequential, Hot };

struct GuestOptions {
    std::vector<std::string> ram_specs;
    std::string control_path; // default: first image + ".ctl"
    uint64_t rate = 10000;    // pages per second (before throttling)
    GuestPattern pattern = GuestPattern::Random;
    uint64_t hot_set = 64 << 20; // bytes, for Hot: the first pages of RAM
    uint64_t seed = 1;
    double duration = 0; // seconds; 0 = until SIGTERM/SIGINT
    // Bytes each write changes: the whole page (4096), or a few words at a
    // random place in it, as a guest updating counters and structures does
    // (what xbzrle is for).
    uint64_t write_bytes = 4096;
};

// Runs until the duration ends or a signal arrives.
Status run_guest(const GuestOptions &opts);

} // namespace qmigd
