#include "daemon/source/migration_thread.h"

#include <bit>
#include <cstring>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/source/mapped_ram_save.h"
#include "daemon/source/multifd_send.h"
#include "daemon/source/page_requests.h"
#include "daemon/source/postcopy_recovery.h"
#include "daemon/source/ram_save.h"
#include "daemon/tls/tls_session.h"
#include "daemon/source/xbzrle_save.h"
#include "daemon/socket_io.h"
#include "protocol/iterable_state.h"
#include "protocol/postcopy.h"
#include "protocol/return_path.h"
#include "protocol/savevm.h"
#include "ramstate/zero_page.h"

namespace qmigd {

namespace {

// Section ids QEMU 10 uses for a -M none guest.
constexpr uint32_t kTimerSectionId = 0;
constexpr uint32_t kRamSectionId = 1;
constexpr uint32_t kGlobalStateSectionId = 3;
// A PART section ends after this long (ram_save_iterate's 50 ms slice).
constexpr auto kSliceTime = std::chrono::milliseconds(50);

} // namespace

MigrationThread::MigrationThread(const OutgoingParams &p, std::vector<RAMBlock> &blocks,
                                 std::vector<int> fds, MigrationShared &shared,
                                 GuestControl *guest, MigrationOwner &owner)
    : p_(p), blocks_(blocks), shared_(shared), guest_(guest), owner_(owner),
      main_fd_(fds[0]), out_(fds[0])
{
    if (p_.mapped_ram) {
        file_ = std::make_unique<MappedRamSave>(blocks_);
    }
    if (p_.multifd) {
        std::vector<int> mfds(fds.begin() + 1, fds.end());
        multifd_ = std::make_unique<MultifdSend>(
            mfds, blocks_, p_.zpd == ZeroPageDetection::Multifd, p_.uuid, file_.get(),
            p_.compression, p_.tls);
    }
    ram_ = std::make_unique<RamSave>(blocks_, p_.zpd, out_, main_fd_, multifd_.get(),
                                     file_.get());
    ram_->count_bytes_in(&shared_.stats.precopy_bytes);
    if (p_.ignore_shared) {
        ram_->ignore_all_blocks();
    }
}

MigrationThread::~MigrationThread()
{
    rp_.reset(); // its reader is joined before the socket it reads goes
    if (main_fd_ >= 0) {
        ::close(main_fd_);
    }
    if (preempt_fd_ >= 0) {
        // Only now, after the destination's SHUT: it ends its reader itself.
        owner_.remove_channel(preempt_fd_);
        ::close(preempt_fd_);
    }
}

uint64_t MigrationThread::transferred() const
{
    return out_.bytes_total() + (multifd_ ? multifd_->bytes() : 0) + ram_->file_bytes();
}


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

// A parked VM keeps the id its first source gave the ram section: its
// device sections are numbered around it.
uint32_t MigrationThread::ram_section_id() const
{
    return p_.parked ? p_.parked->ram_section_id : kRamSectionId;
}

// vmstate_uuid_needed(): with validate-uuid, the VM's UUID if it has one
// (a parked VM's own, else --uuid).
const Uuid *MigrationThread::config_uuid() const
{
    if (!p_.validate_uuid) {
        return nullptr;
    }
    if (p_.parked && p_.parked->uuid) {
        return &*p_.parked->uuid;
    }
    return p_.uuid != Uuid{} ? &p_.uuid : nullptr;
}

// The capabilities the destination must have on too (QEMU's
// vmstate_capabilites: x-ignore-shared and mapped-ram).
std::span<const std::string_view> MigrationThread::config_caps() const
{
    static constexpr std::string_view kBoth[] = {"x-ignore-shared", "mapped-ram"};
    if (p_.ignore_shared && p_.mapped_ram) {
        return kBoth;
    }
    if (p_.ignore_shared) {
        return std::span<const std::string_view>(kBoth, 1);
    }
    if (p_.mapped_ram) {
        return std::span<const std::string_view>(kBoth + 1, 1);
    }
    return {};
}

Status MigrationThread::setup()
{
    if (p_.xbzrle) {
        auto cache = PageCache::create(p_.xbzrle_cache_size, TARGET_PAGE_SIZE);
        QMIGD_TRY(cache);
        xbzrle_ = std::make_unique<XbzrleSave>(std::move(*cache));
        ram_->set_xbzrle(xbzrle_.get());
    }
    if (multifd_) {
        if (p_.zero_copy) {
            QMIGD_TRY(multifd_->enable_zero_copy());
        }
        multifd_->start();
    }
    ByteWriter &w = out_.w();
    savevm_put_header(w);
    savevm_put_configuration(w, p_.machine_type, config_uuid(), config_caps());
    if (p_.return_path || p_.postcopy_ram) {
        // As QEMU's migration_thread(): the destination opens its end, and
        // a PING lines both up.
        QMIGD_TRY(return_path_check(main_fd_));
        savevm_put_command(w, MIG_CMD_OPEN_RETURN_PATH);
        savevm_put_ping(w, RP_PING_OPEN);
        if (p_.postcopy_ram) {
            requests_ = std::make_unique<PageRequests>(ram_block_descs(blocks_));
            recovery_ = std::make_unique<PostcopyRecovery>(ram_block_descs(blocks_));
        }
        rp_ = std::make_unique<ReturnPathIn>(main_fd_, main_tls_.get(), requests_.get(),
                                             recovery_.get());
    }
    if (p_.postcopy_ram) {
        // A destination that cannot do postcopy fails now, not at switchover.
        savevm_put_postcopy_advise(w, ram_->pagesize_summary());
    }
    // The first bytes leave at once: a QEMU destination's main loop stalls
    // peeking at a connection until 4 bytes are there (wire-format 7.1).
    QMIGD_TRY(out_.flush());
    savevm_put_section_header(w, QEMU_VM_SECTION_START, ram_section_id(), "ram", 0,
                              RAM_SECTION_VERSION);
    QMIGD_TRY(ram_->put_ram_layout({p_.postcopy_ram, p_.ignore_shared}));
    // Dirty sync 1: every page is to be sent; what the guest marked so far is
    // already covered, so the shared bitmaps start clean.
    ram_->mark_all_dirty();
    dirty_sync();
    // Never-written ranges go out as zero pages without being read. Learnt
    // after the sync: a page written from here on is dirty again.
    for (auto &b : blocks_) {
        b.image->scan_holes();
    }
    QMIGD_TRY(ram_->round_flush());
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, ram_section_id());
    put_iterable_sections(w, true);
    return out_.flush();
}

// A parked VM's iterable sections other than RAM's (its disks' dirty
// bitmaps), where QEMU's handler order puts them: the START ones after
// RAM's setup, the PART and END ones after RAM's end.
void MigrationThread::put_iterable_sections(ByteWriter &w, bool setup)
{
    if (!p_.parked || p_.parked->iterable_state.empty()) {
        return;
    }
    auto sections = iterable_state_split(p_.parked->iterable_state); // checked when read
    for (const auto &s : sections ? *sections : std::vector<IterableSection>{}) {
        if ((s.type == QEMU_VM_SECTION_START) == setup) {
            w.bytes(s.bytes.data(), s.bytes.size());
        }
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
    while (over_rate() && !(in_postcopy_ && requests_->pending())) {
        QMIGD_TRY(check_cancel());
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

// migration_switchover_prepare() with pause-before-switchover: the VM is
// stopped, the status pre-switchover until migrate-continue (or a cancel).
// Posts left from an earlier migrate-continue are dropped first, as QEMU
// drains its semaphore.
Status MigrationThread::pause_before_switchover(MigrationStatus from)
{
    std::unique_lock<std::mutex> lk(shared_.resume_mu);
    shared_.continue_posts = 0;
    owner_.post_status(from, MigrationStatus::PreSwitchover);
    spdlog::info("migration: paused before switchover, waiting for migrate-continue");
    shared_.resume_cv.wait(lk, [&] { return shared_.continue_posts > 0 || shared_.abandon; });
    if (shared_.abandon) {
        return Error("Switchover is interrupted");
    }
    owner_.post_status(MigrationStatus::PreSwitchover, MigrationStatus::Device);
    return {};
}

Status MigrationThread::stop_for_switchover(bool *running)
{
    if (guest_) {
        // The guest finishes the page in flight and acknowledges; only then
        // does the final dirty sync run, so no write is lost. A guest that
        // does not answer, or a cancel meanwhile, leaves it running.
        Status st = guest_->pause(std::chrono::seconds(5), &shared_.cancel_requested);
        if (!st) {
            owner_.resume_guest_if_running();
            return st;
        }
    }
    // What QEMU's global_state_store() records at switchover: whether the
    // VM runs now (a `stop` or `cont` during the migration counts).
    *running = shared_.vm_running.load();
    downtime_ = true;
    ram_->count_bytes_in(&shared_.stats.downtime_bytes);
    if (xbzrle_) {
        xbzrle_->set_last_stage();
    }
    if (p_.pause_before_switchover) {
        QMIGD_TRY(pause_before_switchover(MigrationStatus::Active));
    } else {
        owner_.post_status(MigrationStatus::Active, MigrationStatus::Device);
    }
    savevm_put_command(out_.w(), MIG_CMD_SWITCHOVER_START);
    return {};
}

void MigrationThread::put_device_state(ByteWriter &w, bool running, bool eof)
{
    if (p_.parked) {
        // Every device section, EOF and the VM description, as received.
        const auto &ds = p_.parked->device_state;
        w.bytes(ds.data(), eof ? ds.size() : p_.parked->device_sections_bytes);
        return;
    }
    savevm_put_timer(w, kTimerSectionId);
    savevm_put_globalstate(w, kGlobalStateSectionId, running ? "running" : "paused");
    if (eof) {
        savevm_put_eof_and_vmdesc(w);
    }
}

Status MigrationThread::complete()
{
    auto stop_time = Clock::now();
    bool running = false;
    QMIGD_TRY(stop_for_switchover(&running));
    ByteWriter &w = out_.w();
    savevm_put_section_continue(w, QEMU_VM_SECTION_END, ram_section_id());
    dirty_sync();
    // Everything left, wrapping as often as needed; send_dirty() ends each
    // pass with the multifd sync, so the last page is followed by one.
    bool round_done = false;
    do {
        QMIGD_TRY(send_dirty(true, &round_done));
    } while (ram_->dirty_pages() > 0);
    // After the channels' last page: ram_save_file_bmap().
    QMIGD_TRY(ram_->write_file_bitmaps());
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, ram_section_id());
    put_iterable_sections(w, false);
    put_device_state(w, running, true);
    QMIGD_TRY(out_.flush());
    shared_.stats.downtime_ms = ms_since(stop_time);
    return {};
}

// A stream that lands in a regular file (file:, or fd: of a file) is on
// stable storage, data and size, before the migration says `completed`:
// the VM's QEMU is usually ended then. One fsync of the inode covers the
// multifd channels' descriptors too, O_DIRECT ones included (their writes
// may still sit in the disk's cache).
Status MigrationThread::sync_if_file()
{
    struct stat st;
    if (fstat(main_fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
        return {};
    }
    if (::fsync(main_fd_) != 0) {
        return Error(fmt::format("Could not sync the migration file: {}", std::strerror(errno)));
    }
    return {};
}

Status MigrationThread::run()
{
    Status st = migrate();
    if (!st && rp_ && !shared_.cancel_requested) {
        // A destination that failed says why on the return path and then
        // closes, which the channels may see first (a write error): its
        // verdict, if it comes within a moment, is the better error.
        if (auto verdict = rp_->failed_within(std::chrono::seconds(1))) {
            return *verdict;
        }
    }
    if (!st && multifd_ && !shared_.cancel_requested) {
        return multifd_peer_closed_hint(st.error());
    }
    return st;
}

Status MigrationThread::migrate()
{
    if (p_.tls.enabled()) {
        auto t = TlsSession::client(main_fd_, *p_.tls.creds, p_.tls.hostname);
        QMIGD_TRY(t);
        main_tls_ = std::move(*t);
        out_.set_tls(main_tls_.get());
    }
    QMIGD_TRY(setup());
    shared_.stats.setup_time_ms = ms_since(shared_.start_time);
    shared_.stats.expected_downtime_ms = int64_t(p_.downtime_limit_ms);
    owner_.post_status(MigrationStatus::Setup, MigrationStatus::Active);
    QMIGD_TRY(iterate());
    if (postcopy_requested()) {
        QMIGD_TRY(postcopy_start());
        QMIGD_TRY(postcopy_run());
    } else {
        QMIGD_TRY(complete());
    }
    if (multifd_) {
        QMIGD_TRY(multifd_->error());
        multifd_->terminate_tls();
        multifd_->shutdown();
    }
    if (rp_) {
        // QEMU's close_return_path_on_source(): the destination's verdict.
        QMIGD_TRY(rp_->wait());
    }
    if (main_tls_) {
        main_tls_->bye();
    }
    QMIGD_TRY(sync_if_file());
    publish();
    shared_.stats.remaining_pages = 0;
    shared_.stats.dirty_pages_rate = 0;
    shared_.stats.total_time_ms = ms_since(shared_.start_time);
    int64_t active = shared_.stats.total_time_ms - shared_.stats.setup_time_ms;
    shared_.stats.mbps = active > 0 ? double(transferred()) * 8 / double(active) / 1000 : 0;
    return {};
}

} // namespace qmigd
