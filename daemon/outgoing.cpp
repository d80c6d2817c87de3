#include "daemon/outgoing.h"

#include <bit>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/mapped_ram_save.h"
#include "daemon/multifd_send.h"
#include "daemon/qemu_file_writer.h"
#include "daemon/ram_save.h"
#include "daemon/socket_io.h"
#include "daemon/io/file_channel.h"
#include "daemon/thread_name.h"
#include "daemon/tls/tls_session.h"
#include "protocol/savevm.h"
#include "ramstate/zero_page.h"

namespace qmigd {

namespace {

using Clock = std::chrono::steady_clock;

// Section ids QEMU 10 uses for a -M none guest.
constexpr uint32_t kTimerSectionId = 0;
constexpr uint32_t kRamSectionId = 1;
constexpr uint32_t kGlobalStateSectionId = 3;
// A PART section ends after this long (ram_save_iterate's 50 ms slice).
constexpr auto kSliceTime = std::chrono::milliseconds(50);

int64_t ms_since(Clock::time_point t)
{
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

} // namespace

// The migration thread's state and steps. Lives on the migration thread.
class OutgoingMigration::Runner {
public:
    Runner(OutgoingMigration &m, std::vector<int> fds)
        : m_(m), p_(m.params_), blocks_(m.blocks_), main_fd_(fds[0]), out_(fds[0])
    {
        if (p_.mapped_ram) {
            file_ = std::make_unique<MappedRamSave>(blocks_);
        }
        if (p_.multifd) {
            std::vector<int> mfds(fds.begin() + 1, fds.end());
            multifd_ = std::make_unique<MultiFDSend>(
                mfds, blocks_, p_.zpd == ZeroPageDetection::Multifd, p_.uuid, file_.get(),
                p_.compression, p_.tls);
        }
        ram_ = std::make_unique<RamSave>(blocks_, p_.zpd, out_, main_fd_, multifd_.get(),
                                         file_.get());
        ram_->count_bytes_in(&m_.stats_->precopy_bytes);
    }
    ~Runner() { ::close(main_fd_); }

    Status run();

private:
    Status setup();
    Status iterate();
    void update_counters();
    Status complete();
    Status send_part(bool *round_done);
    Status send_dirty(bool until_done, bool *round_done);
    uint64_t dirty_sync();
    void end_period();
    Status rate_limit_wait();
    void publish();
    Status check_cancel();
    uint64_t transferred() const
    {
        return out_.bytes_total() + (multifd_ ? multifd_->bytes() : 0) + ram_->file_bytes();
    }

    OutgoingMigration &m_;
    const OutgoingParams p_;
    std::vector<RAMBlock> &blocks_;
    int main_fd_;
    std::unique_ptr<TlsSession> main_tls_; // with tls-creds, after setup's handshake
    QEMUFileWriter out_;
    // mapped-ram: pages go to fixed places in the file, not into the stream.
    std::unique_ptr<MappedRamSave> file_;
    std::unique_ptr<MultiFDSend> multifd_;
    std::unique_ptr<RamSave> ram_; // the bitmaps and the page walk (ram_save.h)
    bool downtime_ = false; // VM stopped: records count as downtime bytes
    // Rate limit: bytes actually written (main + multifd) may not run ahead
    // of max-bandwidth x time since the reference point. Measuring what was
    // written, not what was queued, keeps the long-run rate exact even though
    // the channels lag the main thread by a few packets.
    Clock::time_point rate_start_;
    uint64_t rate_start_bytes_ = 0;
    uint64_t rate_bw_ = 0; // max-bandwidth the reference point was taken for
    bool over_rate();
    // Bandwidth measurement (migration_update_counters).
    Clock::time_point update_start_;
    uint64_t update_bytes_ = 0;
    uint64_t threshold_ = 0; // bytes that fit in downtime-limit; 0 until measured
    // Dirty-rate period (migration_update_rates) and auto-converge state.
    Clock::time_point period_start_ = Clock::now();
    uint64_t period_xfer_start_ = 0;
    uint64_t period_dirty_pages_ = 0;
    unsigned dirty_rate_high_cnt_ = 0;
    uint64_t last_sync_dirty_ = 0; // dirty pages right after the last sync
};

// A dirty sync (migration_bitmap_sync()), with its statistics, the dirty
// rate period and the log line.
uint64_t OutgoingMigration::Runner::dirty_sync()
{
    uint64_t added = ram_->dirty_sync();
    last_sync_dirty_ = ram_->dirty_pages();
    period_dirty_pages_ += added;
    uint64_t n = m_.stats_->dirty_sync_count.fetch_add(1) + 1;
    m_.stats_->remaining_pages = ram_->dirty_pages();
    if (Clock::now() - period_start_ > std::chrono::seconds(1)) {
        end_period();
    }
    m_.dispatcher_.post([&m = m_, n] { m.on_pass_(n); });
    spdlog::info("migration: dirty sync {}: {} pages dirty ({} new, dirty rate {} pages/s, "
                 "throttle {}%)",
                 n, ram_->dirty_pages(), added, m_.stats_->dirty_pages_rate.load(),
                 m_.stats_->cpu_throttle_pct.load());
    return added;
}

// Once a second at most, like migration_bitmap_sync(): the dirty page rate
// of the period and QEMU's auto-converge trigger -- when the guest dirtied
// more than throttle-trigger-threshold % of what was sent, twice in a row,
// throttle it harder.
void OutgoingMigration::Runner::end_period()
{
    auto now = Clock::now();
    double secs = std::chrono::duration<double>(now - period_start_).count();
    uint64_t xfer = transferred() - period_xfer_start_;
    uint64_t dirty_bytes = period_dirty_pages_ * TARGET_PAGE_SIZE;
    m_.stats_->dirty_pages_rate = uint64_t(double(period_dirty_pages_) / secs);
    if (p_.auto_converge && m_.guest_ && !downtime_ &&
        dirty_bytes > xfer * p_.throttle_trigger_threshold / 100 && ++dirty_rate_high_cnt_ >= 2) {
        dirty_rate_high_cnt_ = 0;
        unsigned pct = m_.guest_->throttle();
        pct = pct == 0 ? p_.throttle_initial : std::min(pct + p_.throttle_increment, p_.max_throttle);
        m_.guest_->set_throttle(pct);
        m_.stats_->cpu_throttle_pct = pct;
        spdlog::info("migration: auto-converge: guest throttled to {}%", pct);
    }
    period_start_ = now;
    period_xfer_start_ = transferred();
    period_dirty_pages_ = 0;
}

Status OutgoingMigration::Runner::check_cancel()
{
    if (m_.cancel_requested_) {
        return Error("migration cancelled");
    }
    return {};
}

void OutgoingMigration::Runner::publish()
{
    auto &s = *m_.stats_;
    // Pages and bitmaps the migration thread wrote into a mapped-ram file
    // count as main channel bytes.
    s.main_bytes = out_.bytes_total() + ram_->file_bytes();
    s.multifd_bytes = multifd_ ? multifd_->bytes() : 0;
    s.normal = ram_->normal_pages() + (multifd_ ? multifd_->normal_pages() : 0);
    s.zero = ram_->zero_pages() + (multifd_ ? multifd_->zero_pages() : 0);
    s.remaining_pages = ram_->dirty_pages();
    int64_t active_ms = ms_since(m_.start_time_) - s.setup_time_ms;
    if (active_ms > 0) {
        s.mbps = double(transferred()) * 8 / double(active_ms) / 1000;
        s.pages_per_second = (s.normal + s.zero) * 1000 / uint64_t(active_ms);
    }
}

Status OutgoingMigration::Runner::setup()
{
    if (multifd_) {
        multifd_->start();
    }
    ByteWriter &w = out_.w();
    savevm_put_header(w);
    static constexpr std::string_view kMappedRam[] = {"mapped-ram"};
    savevm_put_configuration(w, p_.machine_type, nullptr,
                             p_.mapped_ram ? std::span<const std::string_view>(kMappedRam)
                                           : std::span<const std::string_view>());
    // The first bytes leave at once: a QEMU destination's main loop stalls
    // peeking at a connection until 4 bytes are there (wire-format 7.1).
    QMIGD_TRY(out_.flush());
    savevm_put_section_header(w, QEMU_VM_SECTION_START, kRamSectionId, "ram", 0,
                              RAM_SECTION_VERSION);
    QMIGD_TRY(ram_->put_ram_layout());
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
    savevm_put_footer(w, kRamSectionId);
    return out_.flush();
}

// Sends dirty pages from the cursor (ram_save.h); a slice ends after
// kSliceTime or when the rate window is used up.
Status OutgoingMigration::Runner::send_dirty(bool until_done, bool *round_done)
{
    auto slice_start = Clock::now();
    return ram_->send_dirty(until_done, round_done, [&] {
        return Clock::now() - slice_start > kSliceTime || over_rate();
    });
}

bool OutgoingMigration::Runner::over_rate()
{
    uint64_t bw = m_.max_bandwidth_;
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

Status OutgoingMigration::Runner::rate_limit_wait()
{
    // Sleep in small steps until the budget catches up, so cancel and
    // bandwidth changes take effect quickly.
    while (over_rate()) {
        QMIGD_TRY(check_cancel());
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return {};
}

Status OutgoingMigration::Runner::send_part(bool *round_done)
{
    savevm_put_section_continue(out_.w(), QEMU_VM_SECTION_PART, kRamSectionId);
    QMIGD_TRY(send_dirty(false, round_done));
    ram_put_flag(out_.w(), RAM_SAVE_FLAG_EOS);
    m_.stats_->precopy_bytes += 8;
    savevm_put_footer(out_.w(), kRamSectionId);
    QMIGD_TRY(out_.flush());
    publish();
    QMIGD_TRY(check_cancel());
    return rate_limit_wait();
}

// Every 100 ms, like migration_update_counters(): the bandwidth of the
// last window gives the switchover threshold (bandwidth x downtime-limit)
// and the expected downtime.
void OutgoingMigration::Runner::update_counters()
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
        m_.stats_->expected_downtime_ms = int64_t(double(pending) * 1000 / bw);
    }
    publish();
}

// migration_iteration_run(): while the remaining dirty memory is above what
// can be sent within downtime-limit, send another PART; when it drops
// below, sync the dirty bitmap and, if it is still below, switch over.
Status OutgoingMigration::Runner::iterate()
{
    update_start_ = Clock::now();
    update_bytes_ = transferred();
    for (;;) {
        // As QEMU 10: sync for the exact figure only when the estimate is
        // under the threshold; switch over when nothing is left or it is
        // under the threshold. (Nothing left before the first bandwidth
        // measurement switches over without a sync: END syncs anyway.)
        uint64_t pending = ram_->dirty_pages() * TARGET_PAGE_SIZE;
        if (pending < threshold_) {
            dirty_sync();
            pending = ram_->dirty_pages() * TARGET_PAGE_SIZE;
        }
        if (pending == 0 || pending < threshold_) {
            return {};
        }
        bool round_done = false;
        QMIGD_TRY(send_part(&round_done));
        update_counters();
    }
}

Status OutgoingMigration::Runner::complete()
{
    auto stop_time = Clock::now();
    if (m_.guest_) {
        // The guest finishes the page in flight and acknowledges; only then
        // does the final dirty sync run, so no write is lost. A guest that
        // does not answer, or a cancel meanwhile, leaves it running.
        Status st = m_.guest_->pause(std::chrono::seconds(5), &m_.cancel_requested_);
        if (!st) {
            m_.resume_guest_if_running();
            return st;
        }
    }
    // What QEMU's global_state_store() records at switchover: whether the
    // VM runs now (a `stop` or `cont` during the migration counts).
    const bool running = m_.vm_running_.load();
    downtime_ = true;
    ram_->count_bytes_in(&m_.stats_->downtime_bytes);
    m_.dispatcher_.post([&m = m_] { m.set_status_from(MigrationStatus::Active,
                                                      MigrationStatus::Device); });
    ByteWriter &w = out_.w();
    savevm_put_command(w, MIG_CMD_SWITCHOVER_START);
    savevm_put_section_continue(w, QEMU_VM_SECTION_END, kRamSectionId);
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
    savevm_put_footer(w, kRamSectionId);
    savevm_put_timer(w, kTimerSectionId);
    savevm_put_globalstate(w, kGlobalStateSectionId, running ? "running" : "paused");
    savevm_put_eof_and_vmdesc(w);
    QMIGD_TRY(out_.flush());
    m_.stats_->downtime_ms = ms_since(stop_time);
    return {};
}

Status OutgoingMigration::Runner::run()
{
    if (p_.tls.enabled() && !p_.mapped_ram) {
        auto t = TlsSession::client(main_fd_, *p_.tls.creds, p_.tls.hostname);
        QMIGD_TRY(t);
        main_tls_ = std::move(*t);
        out_.set_tls(main_tls_.get());
    }
    QMIGD_TRY(setup());
    m_.stats_->setup_time_ms = ms_since(m_.start_time_);
    m_.stats_->expected_downtime_ms = int64_t(p_.downtime_limit_ms);
    m_.dispatcher_.post([&m = m_] { m.set_status_from(MigrationStatus::Setup,
                                                      MigrationStatus::Active); });
    QMIGD_TRY(iterate());
    QMIGD_TRY(complete());
    if (multifd_) {
        QMIGD_TRY(multifd_->error());
        multifd_->terminate_tls();
        multifd_->shutdown();
    }
    if (main_tls_) {
        main_tls_->bye();
    }
    publish();
    m_.stats_->remaining_pages = 0;
    m_.stats_->dirty_pages_rate = 0;
    m_.stats_->total_time_ms = ms_since(m_.start_time_);
    int64_t active = m_.stats_->total_time_ms - m_.stats_->setup_time_ms;
    m_.stats_->mbps = active > 0 ? double(transferred()) * 8 / double(active) / 1000 : 0;
    return {};
}

OutgoingMigration::OutgoingMigration(uv_loop_t *loop, LoopDispatcher &dispatcher,
                                     std::vector<RAMBlock> &blocks, GuestControl *guest,
                                     OnStatus on_status, OnPass on_pass)
    : loop_(loop), dispatcher_(dispatcher), blocks_(blocks), guest_(guest),
      on_status_(std::move(on_status)),
      on_pass_(std::move(on_pass))
{
    for (const auto &b : blocks_) {
        total_bytes_ += b.desc.used_length;
    }
}

OutgoingMigration::~OutgoingMigration()
{
    if (connect_) {
        connect_->cancel(); // its callback would use this object
    }
    if (thread_.joinable()) {
        cancel();
        thread_.join();
    }
    if (child_) {
        child_->terminate(); // the daemon quits: so does a command still running
    }
}

void OutgoingMigration::set_status(MigrationStatus s)
{
    status_ = s;
    on_status_(s);
}

// QEMU's migrate_set_state(): a change posted from the migration thread
// happens only from the state it expects (a cancel may have come between).
void OutgoingMigration::set_status_from(MigrationStatus from, MigrationStatus to)
{
    if (status_ == from) {
        set_status(to);
    }
}

void OutgoingMigration::resume_guest_if_running()
{
    if (guest_ && vm_running_) {
        guest_->resume();
    }
}

Status OutgoingMigration::start(const MigrationAddress &addr, const OutgoingParams &params)
{
    if (thread_.joinable()) {
        thread_.join();
    }
    params_ = params;
    max_bandwidth_ = params.max_bandwidth;
    vm_running_ = params.runstate == "running";
    cancel_requested_ = false;
    error_desc_.clear();
    stats_ = std::make_unique<Stats>();
    start_time_ = std::chrono::steady_clock::now();
    set_status(MigrationStatus::Setup);
    spdlog::info("migration: start to {} (multifd {}, {} channels, compression {}, "
                 "zero-page-detection {}, {} bytes of RAM)",
                 addr.uri(), params.multifd ? "on" : "off",
                 params.multifd ? params.channels : 0,
                 multifd_method(params.multifd ? params.compression.method
                                               : MultiFDCompression::None)
                     .name,
                 zero_page_detection_name(params.zpd), total_bytes_);
    uint64_t gen = ++generation_;
    child_.reset();
    if (params.tls_error) {
        on_connected(*params.tls_error);
        return {};
    }
    if (addr.transport != MigrationAddress::Transport::Socket) {
        // One file or pipe. QEMU fails both the migration and the command
        // when it cannot be opened.
        auto fd = one_channel_open(loop_, addr, true, fd_source_, &child_);
        if (!fd) {
            on_connected(fd.error());
            return fd.error();
        }
        std::vector<int> fds{*fd};
        if (params.mapped_ram && params.multifd) {
            auto more = file_channels_open(addr, true, params.channels, params.direct_io);
            if (!more) { // QEMU opens them after `migrate` returned: only the migration fails
                ::close(*fd);
                on_connected(more.error());
                return {};
            }
            fds.insert(fds.end(), more->begin(), more->end());
        }
        on_connected(std::move(fds));
        return {};
    }
    unsigned count = 1 + (params.multifd ? params.channels : 0);
    auto done = [this, gen](Result<std::vector<int>> fds) {
        connect_.reset();
        if (gen != generation_ || status_ != MigrationStatus::Setup) {
            if (fds) {
                for (int fd : *fds) {
                    ::close(fd);
                }
            }
            return;
        }
        on_connected(std::move(fds));
    };
    connect_ = SocketConnect::start(loop_, addr.socket, count, std::move(done));
    return {};
}

void OutgoingMigration::on_connected(Result<std::vector<int>> fds)
{
    if (!fds) {
        finish(fds.error());
        return;
    }
    for (int fd : *fds) {
        set_link_timeout(fd, params_.link_timeout_ms);
    }
    {
        std::lock_guard<std::mutex> lk(fds_mu_);
        fds_ = *fds;
    }
    thread_ = std::thread([this, fds = *fds] {
        set_thread_name("mig/src/main");
        std::optional<Error> err;
        {
            Runner r(*this, fds);
            Status st = r.run();
            if (!st) {
                err = st.error();
            }
            // Forget the fds before ~Runner closes them: a cancel after
            // that must not shut down a number the process reuses.
            std::lock_guard<std::mutex> lk(fds_mu_);
            fds_.clear();
        } // channels closed here
        dispatcher_.post([this, err] { finish(err); });
    });
}

void OutgoingMigration::finish(std::optional<Error> err)
{
    if (thread_.joinable()) {
        thread_.join();
    }
    if (stats_->total_time_ms == 0) {
        stats_->total_time_ms = ms_since(start_time_);
    }
    if (guest_) {
        guest_->set_throttle(0); // cpu_throttle_stop()
    }
    if (cancel_requested_ || err) {
        // A VM that was running runs on, wherever the switchover stopped.
        resume_guest_if_running();
        if (child_) {
            child_->terminate(); // half a stream is of no use to it
        }
    }
    if (cancel_requested_) {
        spdlog::info("migration: cancelled after {} ms", stats_->total_time_ms.load());
        set_status(MigrationStatus::Cancelled);
        return;
    }
    if (err) {
        spdlog::error("migration failed: {}", err->message());
        error_desc_ = err->message();
        set_status(MigrationStatus::Failed);
        return;
    }
    spdlog::info("migration: completed in {} ms (setup {} ms, downtime {} ms): {} bytes "
                 "transferred, {} normal pages, {} zero pages, {} dirty syncs, {:.2f} mbps",
                 stats_->total_time_ms.load(), stats_->setup_time_ms.load(),
                 stats_->downtime_ms.load(),
                 stats_->main_bytes.load() + stats_->multifd_bytes.load(), stats_->normal.load(),
                 stats_->zero.load(), stats_->dirty_sync_count.load(), stats_->mbps.load());
    set_status(MigrationStatus::Completed);
}

void OutgoingMigration::cancel()
{
    if (!migration_is_running(status_)) {
        return;
    }
    cancel_requested_ = true;
    set_status(MigrationStatus::Cancelling);
    std::lock_guard<std::mutex> lk(fds_mu_);
    for (int fd : fds_) {
        shutdown_fd(fd);
    }
    if (child_) {
        child_->terminate(); // a pipe cannot be shut down: its reader goes
    }
    if (!thread_.joinable()) {
        // Still connecting: abort the lookup and connects now.
        if (connect_) {
            connect_->cancel();
            connect_.reset();
        }
        ++generation_;
        dispatcher_.post([this] { finish(std::nullopt); });
    }
}

nlohmann::json OutgoingMigration::query() const
{
    using nlohmann::json;
    if (status_ == MigrationStatus::None) {
        return json::object();
    }
    json r = {{"status", migration_status_name(status_)}};
    switch (status_) {
    case MigrationStatus::Setup:
    case MigrationStatus::Cancelled:
        return r;
    case MigrationStatus::Failed:
        if (!error_desc_.empty()) {
            r["error-desc"] = error_desc_;
        }
        return r;
    default:
        break;
    }
    const auto &s = *stats_;
    bool done = status_ == MigrationStatus::Completed;
    r["setup-time"] = s.setup_time_ms.load();
    r["total-time"] = done ? s.total_time_ms.load() : ms_since(start_time_);
    if (done) {
        r["downtime"] = s.downtime_ms.load();
    } else {
        r["expected-downtime"] = s.expected_downtime_ms.load();
        if (s.cpu_throttle_pct) {
            r["cpu-throttle-percentage"] = s.cpu_throttle_pct.load();
        }
    }
    uint64_t normal = s.normal, zero = s.zero;
    r["ram"] = {
        {"transferred", s.main_bytes + s.multifd_bytes},
        {"remaining", done ? 0 : s.remaining_pages * TARGET_PAGE_SIZE},
        {"total", total_bytes_},
        {"duplicate", zero},
        {"zero", zero},
        {"zero-bytes", zero * TARGET_PAGE_SIZE},
        {"normal", normal},
        {"normal-bytes", normal * TARGET_PAGE_SIZE},
        {"dirty-pages-rate", s.dirty_pages_rate.load()},
        {"mbps", s.mbps.load()},
        {"dirty-sync-count", s.dirty_sync_count.load()},
        {"postcopy-requests", 0},
        {"page-size", TARGET_PAGE_SIZE},
        {"multifd-bytes", s.multifd_bytes.load()},
        {"pages-per-second", s.pages_per_second.load()},
        {"precopy-bytes", s.precopy_bytes.load()},
        {"downtime-bytes", s.downtime_bytes.load()},
        {"postcopy-bytes", 0},
        {"dirty-sync-missed-zero-copy", 0},
    };
    return r;
}

} // namespace qmigd
