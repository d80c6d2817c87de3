// calc-dirty-rate's measurement on a source (QEMU 10's migration/
// dirtyrate.c): one at a time on its own thread, "mig/dirtyrate", over the
// source's RAM blocks, in page-sampling or dirty-bitmap mode.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <thread>
#include <vector>

#include "daemon/ram_blocks.h"
#include "daemon/thread_safety.h"

namespace qmigd {

// QAPI DirtyRateMeasureMode and DirtyRateStatus, in the schema's order.
enum class DirtyRateMode { PageSampling, DirtyRing, DirtyBitmap };
enum class DirtyRateStatus { Unstarted, Measuring, Measured };

struct DirtyRateConfig {
    int64_t calc_time_ms = 1000;
    uint64_t sample_pages = 512; // per GiB, page-sampling only
    DirtyRateMode mode = DirtyRateMode::PageSampling;
};

// What query-dirty-rate shows (DirtyStat): the last measurement or the one
// under way.
struct DirtyRateStat {
    DirtyRateStatus status = DirtyRateStatus::Unstarted;
    DirtyRateMode mode = DirtyRateMode::PageSampling;
    int64_t start_time = 0;   // Unix seconds
    int64_t calc_time_ms = 0; // asked for while measuring; taken once measured
    uint64_t sample_pages = 0;
    int64_t dirty_rate = -1; // MB/s; -1: nothing could be measured
};

class DirtyRateMeasure {
public:
    // `blocks` outlive this (the source's, fixed once opened).
    explicit DirtyRateMeasure(const std::vector<RAMBlock> &blocks) : blocks_(blocks) {}
    // Ends a measurement under way (its wait is cut short) and joins it.
    ~DirtyRateMeasure();
    DirtyRateMeasure(const DirtyRateMeasure &) = delete;
    DirtyRateMeasure &operator=(const DirtyRateMeasure &) = delete;

    // Loop thread. Starts a measurement; false (nothing started) while one
    // is measuring.
    bool start(const DirtyRateConfig &config);
    // Any thread.
    DirtyRateStat stat() const;

private:
    void run(DirtyRateConfig config);
    int64_t wait_from(int64_t start_ms, int64_t calc_time_ms);
    int64_t measure_dirty_bitmap(const DirtyRateConfig &config);
    int64_t measure_page_sampling(const DirtyRateConfig &config);
    void set_start_time();
    // Quit is waiting: a long page-sampling (a huge guest) ends early.
    bool stopping() const;

    const std::vector<RAMBlock> &blocks_;
    mutable Mutex mu_;
    std::condition_variable wake_; // stop_ set
    DirtyRateStat stat_ GUARDED_BY(mu_);
    bool stop_ GUARDED_BY(mu_) = false;
    std::thread thread_; // the loop thread starts and joins it
};

} // namespace qmigd
