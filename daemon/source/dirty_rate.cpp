// The dirty-rate thread: dirty-bitmap counts what the shared dirty bitmaps
// collect; page-sampling hashes random pages twice, as QEMU 10 does.
#include "daemon/source/dirty_rate.h"

#include <chrono>
#include <random>

#include <spdlog/spdlog.h>

#include "daemon/monotonic_clock.h"
#include "daemon/thread_name.h"
#include "ramstate/dirty_rate.h"

namespace qmigd {

namespace {

int64_t unix_seconds()
{
    using namespace std::chrono;
    return duration_cast<seconds>(system_clock::now().time_since_epoch()).count();
}

// One block's samples (RamblockDirtyInfo): page numbers and first hashes.
struct BlockSamples {
    const RAMBlock *block;
    std::vector<uint64_t> pages;
    std::vector<uint32_t> hashes;
};

// The page's hash; false if it cannot be read.
bool hash_page(const RAMBlock &b, uint64_t page, uint32_t *hash)
{
    alignas(64) uint8_t buf[TARGET_PAGE_SIZE];
    if (!b.image->read(page * TARGET_PAGE_SIZE, buf, sizeof(buf))) {
        return false;
    }
    *hash = dirty_rate_page_hash(buf);
    return true;
}

} // namespace

DirtyRateMeasure::~DirtyRateMeasure()
{
    {
        MutexLock lock(mu_);
        stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) {
        thread_.join();
    }
}

bool DirtyRateMeasure::start(const DirtyRateConfig &config)
{
    {
        MutexLock lock(mu_);
        if (stat_.status == DirtyRateStatus::Measuring) {
            return false;
        }
        // init_dirtyrate_stat(), and measuring at once: a second
        // calc-dirty-rate right after this one is refused.
        stat_ = {DirtyRateStatus::Measuring, config.mode, unix_seconds(), config.calc_time_ms,
                 config.sample_pages, -1};
    }
    if (thread_.joinable()) {
        thread_.join(); // the last one, which has ended
    }
    thread_ = std::thread([this, config] {
        set_thread_name("mig/dirtyrate");
        run(config);
    });
    return true;
}

DirtyRateStat DirtyRateMeasure::stat() const
{
    MutexLock lock(mu_);
    return stat_;
}

void DirtyRateMeasure::run(DirtyRateConfig config)
{
    int64_t rate = config.mode == DirtyRateMode::DirtyBitmap ? measure_dirty_bitmap(config)
                                                             : measure_page_sampling(config);
    MutexLock lock(mu_);
    stat_.dirty_rate = rate;
    stat_.status = DirtyRateStatus::Measured;
}

bool DirtyRateMeasure::stopping() const
{
    MutexLock lock(mu_);
    return stop_;
}

void DirtyRateMeasure::set_start_time()
{
    MutexLock lock(mu_);
    stat_.start_time = unix_seconds();
}

// dirty_stat_wait(): sleeps until `calc_time_ms` after `start_ms` (or quit)
// and records how long it really was.
int64_t DirtyRateMeasure::wait_from(int64_t start_ms, int64_t calc_time_ms)
{
    {
        MutexLock lock(mu_);
        auto until = std::chrono::steady_clock::time_point(std::chrono::milliseconds(start_ms +
                                                                                     calc_time_ms));
        while (!stop_ && std::chrono::steady_clock::now() < until) {
            lock.wait_until(wake_, until);
        }
    }
    int64_t took = monotonic_ms() - start_ms;
    MutexLock lock(mu_);
    stat_.calc_time_ms = took;
    return took;
}

// calculate_dirtyrate_dirty_bitmap(): a first sync whose pages do not
// count, the wait, a second sync; pages collected in between by anyone
// (the migration's syncs too) are the pages dirtied. The syncs leave what
// they take for the migration (DirtyBitmap::sync_to_pending), so a
// measurement during a migration takes nothing from it.
int64_t DirtyRateMeasure::measure_dirty_bitmap(const DirtyRateConfig &config)
{
    auto sync = [this] {
        uint64_t total = 0;
        for (const auto &b : blocks_) {
            if (b.dirty && !b.dirty->sync_to_pending()) {
                spdlog::warn("dirty rate: no memory to collect {}'s dirty pages", b.desc.idstr);
            }
            total += b.dirty ? b.dirty->collected() : 0;
        }
        return total;
    };
    uint64_t before = sync();
    int64_t start = monotonic_ms();
    set_start_time();
    int64_t took = wait_from(start, config.calc_time_ms);
    return dirty_rate_from_pages(sync() - before, took);
}

// calculate_dirtyrate_sample_vm(): hash sample_pages per GiB of every block
// of 128 KiB or more at random pages, wait, hash them again; the share of
// changed hashes times the blocks' size is the rate.
int64_t DirtyRateMeasure::measure_page_sampling(const DirtyRateConfig &config)
{
    int64_t start = monotonic_ms();
    set_start_time();
    std::mt19937_64 rng{std::random_device{}()};
    std::vector<BlockSamples> samples;
    for (const auto &b : blocks_) {
        uint64_t bytes = b.image->size(), pages = b.image->pages();
        if (bytes < kDirtyRateMinBlockBytes) {
            continue;
        }
        BlockSamples s{&b, {}, {}};
        // g_rand_int_range(0, pages - 1): the last page is never picked.
        std::uniform_int_distribution<uint64_t> pick(0, pages - 2);
        for (uint64_t i = dirty_rate_samples(bytes, config.sample_pages); i > 0; i--) {
            uint32_t h = 0;
            uint64_t page = pick(rng);
            if (i % 4096 == 0 && stopping()) {
                return -1;
            }
            if (!hash_page(b, page, &h)) {
                return -1;
            }
            s.pages.push_back(page);
            s.hashes.push_back(h);
        }
        samples.push_back(std::move(s));
    }
    int64_t took = wait_from(start, config.calc_time_ms);
    uint64_t dirty = 0, count = 0, mib = 0;
    for (const auto &s : samples) {
        for (size_t i = 0; i < s.pages.size(); i++) {
            uint32_t h = 0;
            if (i % 4096 == 0 && stopping()) {
                return -1;
            }
            if (!hash_page(*s.block, s.pages[i], &h)) {
                return -1;
            }
            dirty += h != s.hashes[i];
        }
        count += s.pages.size();
        mib += s.block->image->size() >> 20;
    }
    return count ? dirty_rate_from_samples(dirty, count, mib, took) : -1;
}

} // namespace qmigd
