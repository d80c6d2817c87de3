// MigrationThread's precopy iterations: dirty syncs, rate limit, counters, switchover's decision.
#include <thread>

#include <spdlog/spdlog.h>

#include "daemon/source/migration_thread.h"
#include "daemon/source/multifd_send.h"
#include "daemon/source/page_requests.h"
#include "daemon/source/ram_save.h"
#include "daemon/source/xbzrle_save.h"
#include "protocol/savevm.h"
#include "ramstate/zero_page.h"

namespace qmigd {

namespace {

// A PART section ends after this long (ram_save_iterate's 50 ms slice).
constexpr auto kSliceTime = std::chrono::milliseconds(50);

} // namespace

// A dirty sync (migration_bitmap_sync()), with its statistics, the dirty
// rate period and the log line.
uint64_t MigrationThread::dirty_sync()
{
    uint64_t added = ram_->dirty_sync();
    last_sync_dirty_ = ram_->dirty_pages();
    period_dirty_pages_ += added;
    uint64_t n = shared_.stats.dirty_sync_count.fetch_add(1) + 1;
    shared_.stats.remaining_pages = ram_->dirty_pages();
    if (Clock::now() - period_start_ > std::chrono::seconds(1)) {
        end_period();
    }
    owner_.post_pass(n);
    spdlog::info("migration: dirty sync {}: {} pages dirty ({} new, dirty rate {} pages/s, "
                 "throttle {}%)",
                 n, ram_->dirty_pages(), added, shared_.stats.dirty_pages_rate.load(),
                 shared_.stats.cpu_throttle_pct.load());
    return added;
}

// Once a second at most, like migration_bitmap_sync(): the dirty page rate
// of the period and QEMU's auto-converge trigger -- when the guest dirtied
// more than throttle-trigger-threshold % of what was sent, twice in a row,
// throttle it harder.
void MigrationThread::end_period()
{
    auto now = Clock::now();
    double secs = std::chrono::duration<double>(now - period_start_).count();
    uint64_t xfer = transferred() - period_xfer_start_;
    uint64_t dirty_bytes = period_dirty_pages_ * TARGET_PAGE_SIZE;
    shared_.stats.dirty_pages_rate = uint64_t(double(period_dirty_pages_) / secs);
    update_xbzrle_rates();
    if (p_.auto_converge && guest_ && !downtime_ &&
        dirty_bytes > xfer * p_.throttle_trigger_threshold / 100 && ++dirty_rate_high_cnt_ >= 2) {
        dirty_rate_high_cnt_ = 0;
        unsigned pct = guest_->throttle();
        pct = pct == 0 ? p_.throttle_initial : std::min(pct + p_.throttle_increment, p_.max_throttle);
        guest_->set_throttle(pct);
        shared_.stats.cpu_throttle_pct = pct;
        spdlog::info("migration: auto-converge: guest throttled to {}%", pct);
    }
    period_start_ = now;
    period_xfer_start_ = transferred();
    period_dirty_pages_ = 0;
}

// migration_update_rates(): the period's cache miss rate (misses per page
// sent) and encoding rate (bytes the encoded pages had, per byte sent).
void MigrationThread::update_xbzrle_rates()
{
    if (!xbzrle_) {
        return;
    }
    const XbzrleCounters &c = xbzrle_->counters;
    uint64_t sent = ram_->normal_pages() + ram_->zero_pages() + c.pages;
    uint64_t page_count = sent - xbzrle_prev_.sent;
    if (page_count == 0) {
        return;
    }
    auto &s = shared_.stats;
    s.xbzrle_cache_miss_rate = double(c.cache_miss - xbzrle_prev_.cache_miss) / double(page_count);
    uint64_t encoded = c.bytes - xbzrle_prev_.bytes;
    s.xbzrle_encoding_rate = c.pages == xbzrle_prev_.pages || encoded == 0
                                 ? 0.0
                                 : double((c.pages - xbzrle_prev_.pages) * TARGET_PAGE_SIZE) /
                                       double(encoded);
    xbzrle_prev_ = {sent, c.cache_miss, c.pages, c.bytes};
}

Status MigrationThread::check_cancel()
{
    if (shared_.cancel_requested) {
        return Error("migration cancelled");
    }
    if (auto err = rp_ ? rp_->failed() : std::nullopt) {
        return *err; // the destination failed, or its return path broke
    }
    return {};
}

void MigrationThread::publish()
{
    auto &s = shared_.stats;
    // Pages and bitmaps the migration thread wrote into a mapped-ram file
    // count as main channel bytes.
    s.main_bytes = out_.bytes_total() + ram_->file_bytes();
    s.multifd_bytes = multifd_ ? multifd_->bytes() : 0;
    s.zero_copy_missed = multifd_ ? multifd_->zero_copy_missed() : 0;
    s.normal = ram_->normal_pages() + (multifd_ ? multifd_->normal_pages() : 0);
    s.zero = ram_->zero_pages() + (multifd_ ? multifd_->zero_pages() : 0);
    s.remaining_pages = ram_->dirty_pages();
    if (xbzrle_) {
        s.xbzrle_bytes = xbzrle_->counters.bytes;
        s.xbzrle_pages = xbzrle_->counters.pages;
        s.xbzrle_cache_miss = xbzrle_->counters.cache_miss;
        s.xbzrle_overflow = xbzrle_->counters.overflow;
    }
    int64_t active_ms = ms_since(shared_.start_time) - s.setup_time_ms;
    if (active_ms > 0) {
        s.mbps = double(transferred()) * 8 / double(active_ms) / 1000;
        s.pages_per_second = (s.normal + s.zero) * 1000 / uint64_t(active_ms);
    }
}

// Sends dirty pages from the cursor (ram_save.h); a slice ends after
// kSliceTime or when the rate window is used up.
Status MigrationThread::send_dirty(bool until_done, bool *round_done)
{
    auto slice_start = Clock::now();
    return ram_->send_dirty(until_done, round_done, [&] {
        return Clock::now() - slice_start > kSliceTime || over_rate();
    });
}

// max-bandwidth, or max-postcopy-bandwidth once in postcopy.
uint64_t MigrationThread::rate_limit() const
{
    return in_postcopy_ ? shared_.max_postcopy_bandwidth.load() : shared_.max_bandwidth.load();
}

bool MigrationThread::over_rate()
{
    uint64_t bw = rate_limit();
    if (bw != rate_bw_) { // unlimited, or changed by migrate-set-parameters
        rate_bw_ = bw;
        rate_start_ = Clock::now();
        rate_start_bytes_ = transferred();
    }
    if (bw == 0) {
        return false;
    }
    double allowed = double(bw) * std::chrono::duration<double>(Clock::now() - rate_start_).count();
    return double(transferred() - rate_start_bytes_) > allowed;
}

Status MigrationThread::rate_limit_wait()
{
    // Sleep in small steps until the budget catches up, so cancel and
    // bandwidth changes take effect quickly.
    // A destination's page request goes before the limit: its guest waits.
    // So does a precopy channel that broke or was yanked: the thread goes on
    // to the write that fails (QEMU's multifd error wakes its rate limit
    // too), not seconds later when the budget would allow it at a low
    // max-bandwidth. (In postcopy a yank breaks the return path, which
    // check_cancel() sees; the flag stays set through the recovery after.)
    while (over_rate() && !(in_postcopy_ && requests_->pending()) &&
           !(!in_postcopy_ && shared_.yanked)) {
        QMIGD_TRY(check_cancel());
        if (multifd_) {
            QMIGD_TRY(multifd_->error());
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return {};
}

Status MigrationThread::send_part(bool *round_done)
{
    savevm_put_section_continue(out_.w(), QEMU_VM_SECTION_PART, ram_section_id());
    QMIGD_TRY(send_dirty(false, round_done));
    ram_put_flag(out_.w(), RAM_SAVE_FLAG_EOS);
    shared_.stats.precopy_bytes += 8;
    savevm_put_footer(out_.w(), ram_section_id());
    QMIGD_TRY(out_.flush());
    publish();
    QMIGD_TRY(check_cancel());
    return rate_limit_wait();
}

// Every 100 ms, like migration_update_counters(): the bandwidth of the
// last window gives the switchover threshold (bandwidth x downtime-limit)
// and the expected downtime.
void MigrationThread::update_counters()
{
    auto now = Clock::now();
    double secs = std::chrono::duration<double>(now - update_start_).count();
    if (secs < 0.1) {
        return;
    }
    uint64_t bytes = transferred();
    double bw = secs > 0 ? double(bytes - update_bytes_) / secs : 0; // bytes/s
    update_start_ = now;
    update_bytes_ = bytes;
    threshold_ = uint64_t(bw * double(p_.downtime_limit_ms) / 1000);
    if (bw > 0) {
        // What stopping now would leave: at least the dirty set of the last
        // sync (the guest keeps re-dirtying it while we send), not just the
        // unsent rest of it, which drops to zero at every round's end.
        uint64_t pending = std::max(ram_->dirty_pages(), last_sync_dirty_) * TARGET_PAGE_SIZE;
        shared_.stats.expected_downtime_ms = int64_t(double(pending) * 1000 / bw);
    }
    publish();
}

// migration_iteration_run(): while the remaining dirty memory is above what
// can be sent within downtime-limit, send another PART; when it drops
// below, sync the dirty bitmap and, if it is still below, switch over.
Status MigrationThread::iterate()
{
    update_start_ = Clock::now();
    update_bytes_ = transferred();
    for (;;) {
        // As QEMU 10's migration_iteration_run(): sync for the exact figure
        // only when the estimate is under the threshold; switch over when
        // nothing is left or it is under the threshold. Nothing left before
        // the first bandwidth sample (100 ms) switches over without a sync,
        // so no MIGRATION_PASS stands between MIGRATION(active) and STOP
        // then, in QEMU 10 as here (END syncs anyway).
        uint64_t pending = ram_->dirty_pages() * TARGET_PAGE_SIZE;
        if (pending < threshold_) {
            dirty_sync();
            pending = ram_->dirty_pages() * TARGET_PAGE_SIZE;
        }
        bool can_switchover = switchover_acked();
        if ((pending == 0 || pending < threshold_) && can_switchover) {
            return {};
        }
        if (postcopy_requested() && can_switchover) {
            return {};
        }
        if (pending == 0) {
            // Only the destination's ack is missing and the guest wrote
            // nothing: wait for the ack (or a slice) instead of syncing
            // again at once; a cancel ends the reader, which wakes us.
            QMIGD_TRY(check_cancel());
            rp_->wait_switchover_ack(kSliceTime);
            update_counters();
            continue;
        }
        bool round_done = false;
        QMIGD_TRY(send_part(&round_done));
        update_counters();
    }
}

// migration_can_switchover(): with switchover-ack, not before the
// destination said so, unless the VM is stopped anyway.
bool MigrationThread::switchover_acked() const
{
    if (!p_.switchover_ack || !shared_.vm_running) {
        return true;
    }
    return rp_ && rp_->switchover_acked();
}

} // namespace qmigd
