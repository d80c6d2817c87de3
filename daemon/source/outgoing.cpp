// OutgoingMigration: the source's loop side (migrate, cancel, pause, resume, query-migrate).
#include "daemon/source/outgoing.h"

#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/socket_io.h"
#include "daemon/io/file_channel.h"
#include "daemon/migration_threads.h"
#include "daemon/thread_name.h"
#include "ramstate/zero_page.h"

namespace qmigd {

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
    if (child_) {
        child_->kill_now(); // the daemon quits: so does the command, all of it
    }
    if (thread_.joinable()) {
        cancel();
        thread_.join();
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

void OutgoingMigration::post_status(MigrationStatus from, MigrationStatus to)
{
    dispatcher_.post([this, from, to] { set_status_from(from, to); });
}

void OutgoingMigration::post_pass(uint64_t n)
{
    dispatcher_.post([this, n] { on_pass_(n); });
}

void OutgoingMigration::resume_guest_if_running()
{
    if (guest_ && shared_->vm_running) {
        guest_->resume();
    }
}

// A channel added after a cancel is shut down at once: the cancel sets its
// flag before it takes the lock to shut down the channels it knows.
void OutgoingMigration::add_channel(Channel &ch)
{
    MutexLock lk(channels_mu_);
    channels_.push_back(&ch);
    if (shared_->cancel_requested) {
        ch.shutdown();
    }
}

void OutgoingMigration::remove_channel(Channel &ch)
{
    MutexLock lk(channels_mu_);
    std::erase(channels_, &ch);
}

void OutgoingMigration::shutdown_channels()
{
    MutexLock lk(channels_mu_);
    for (Channel *ch : channels_) {
        ch->shutdown();
    }
}

Status OutgoingMigration::start(const MigrationAddress &addr, const OutgoingParams &params)
{
    if (thread_.joinable()) {
        thread_.join();
    }
    params_ = params;
    shared_ = std::make_unique<MigrationShared>();
    shared_->max_bandwidth = params.max_bandwidth;
    shared_->max_postcopy_bandwidth = params.max_postcopy_bandwidth;
    shared_->vm_running = params.runstate == "running";
    shared_->start_time = std::chrono::steady_clock::now();
    error_desc_.clear();
    set_status(MigrationStatus::Setup);
    spdlog::info("migration: start to {} ({}, zero-page-detection {}, {} bytes of RAM)",
                 addr.uri(),
                 params.multifd ? fmt::format("multifd, {} channels, compression {}",
                                              params.channels,
                                              multifd_method(params.compression.method).name)
                                : std::string("main channel only, no multifd"),
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
        auto fd = open_one_channel(loop_, addr, true, params.tls.enabled(), fd_source_,
                                   &child_);
        if (!fd) {
            on_connected(fd.error());
            return fd.error();
        }
        std::vector<UniqueFd> fds;
        fds.push_back(std::move(*fd));
        if (params.mapped_ram && params.multifd) {
            auto more = open_file_channels(addr, true, params.channels, params.direct_io);
            if (!more) { // QEMU opens them after `migrate` returned: only the migration fails
                on_connected(more.error()); // the main channel's descriptor closes with fds
                return {};
            }
            for (UniqueFd &f : *more) {
                fds.push_back(std::move(f));
            }
        }
        on_connected(std::move(fds));
        return {};
    }
    unsigned count = 1 + (params.multifd ? params.channels : 0);
    auto done = [this, gen](Result<std::vector<UniqueFd>> fds) {
        connect_.reset();
        if (gen != generation_ || status_ != MigrationStatus::Setup) {
            return; // a cancelled attempt's: closed with `fds`
        }
        on_connected(std::move(fds));
    };
    connect_ = SocketConnect::start(loop_, addr.socket, count, std::move(done));
    return {};
}

void OutgoingMigration::on_connected(Result<std::vector<UniqueFd>> fds)
{
    if (!fds) {
        finish(fds.error());
        return;
    }
    bool local =
        params_.local_send_buffer && !fds->empty() && peer_is_local(fds->front().get());
    for (const UniqueFd &fd : *fds) {
        set_link_timeout(fd.get(), params_.link_timeout_ms);
        if (local) {
            set_send_buffer(fd.get(), params_.local_send_buffer);
        }
    }
    if (local) {
        spdlog::info("destination is on this host: send buffers of {} KiB per channel",
                     params_.local_send_buffer >> 10);
    }
    thread_ = std::thread([this, fds = std::move(*fds)]() mutable {
        set_thread_name("mig/src/main");
        std::optional<Error> err;
        {
            ListedMigrationThread listed("mig/src/main"); // query-migrationthreads
            MigrationThread t(params_, blocks_, std::move(fds), *shared_, guest_, *this);
            Status st = t.run();
            if (!st) {
                err = st.error();
            }
        } // channels closed here
        dispatcher_.post([this, err] { finish(err); });
    });
}

void OutgoingMigration::finish(std::optional<Error> err)
{
    if (thread_.joinable()) {
        thread_.join();
    }
    if (shared_->stats.total_time_ms == 0) {
        shared_->stats.total_time_ms = ms_since(shared_->start_time);
    }
    if (guest_) {
        guest_->set_throttle(0); // cpu_throttle_stop()
    }
    if ((shared_->cancel_requested || err) && shared_->vm_handed_over) {
        spdlog::error("migration: failed in postcopy: the VM may run at the destination, so "
                      "it stays paused here");
    } else if (shared_->cancel_requested || err) {
        // A VM that was running runs on, wherever the switchover stopped.
        resume_guest_if_running();
        if (child_) {
            child_->terminate(); // half a stream is of no use to it
        }
    }
    if (shared_->cancel_requested) {
        spdlog::info("migration: cancelled after {} ms", shared_->stats.total_time_ms.load());
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
                 shared_->stats.total_time_ms.load(), shared_->stats.setup_time_ms.load(),
                 shared_->stats.downtime_ms.load(),
                 shared_->stats.main_bytes.load() + shared_->stats.multifd_bytes.load(), shared_->stats.normal.load(),
                 shared_->stats.zero.load(), shared_->stats.dirty_sync_count.load(), shared_->stats.mbps.load());
    set_status(MigrationStatus::Completed);
}

void OutgoingMigration::cancel()
{
    if (!migration_is_running(status_)) {
        return;
    }
    shared_->cancel_requested = true;
    {
        MutexLock lk(shared_->resume_mu);
        shared_->abandon = true; // a paused postcopy waits for nothing more
    }
    shared_->resume_cv.notify_all();
    set_status(MigrationStatus::Cancelling);
    shutdown_channels();
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

void OutgoingMigration::continue_switchover()
{
    {
        MutexLock lk(shared_->resume_mu);
        shared_->continue_posts++;
    }
    shared_->resume_cv.notify_all();
}

void OutgoingMigration::pause()
{
    spdlog::info("migration: postcopy paused by migrate-pause");
    {
        MutexLock lk(shared_->resume_mu);
        shared_->pause_error = "Postcopy migration is paused by the user";
    }
    shutdown_channels();
}

Status OutgoingMigration::resume(const MigrationAddress &addr)
{
    if (status_ != MigrationStatus::PostcopyPaused) {
        return Error("Cannot resume if there is no paused migration");
    }
    if (addr.transport != MigrationAddress::Transport::Socket) {
        return Error("qmigd: a postcopy migration resumes over tcp: or unix: only");
    }
    set_status(MigrationStatus::PostcopyRecoverSetup);
    uint64_t gen = ++generation_;
    auto done = [this, gen](Result<std::vector<UniqueFd>> fds) {
        connect_.reset();
        if (gen != generation_ || status_ != MigrationStatus::PostcopyRecoverSetup) {
            return; // closed with `fds`
        }
        if (!fds) {
            // Never fail a postcopy migration: paused again, for another try.
            spdlog::error("migration: resume failed: {}", fds.error().message());
            MutexLock lk(shared_->resume_mu);
            shared_->pause_error = fds.error().message();
            set_status(MigrationStatus::PostcopyPaused);
            return;
        }
        set_link_timeout(fds->front().get(), params_.link_timeout_ms);
        set_status(MigrationStatus::PostcopyRecover);
        auto ch = std::make_unique<Channel>(std::move(fds->front()));
        add_channel(*ch); // cancel and migrate-pause shut it from now on
        {
            MutexLock lk(shared_->resume_mu);
            shared_->resume_channel = std::move(ch);
            shared_->pause_error.clear(); // migrate_error_free()
        }
        shared_->resume_cv.notify_all();
    };
    connect_ = SocketConnect::start(loop_, addr.socket, 1, std::move(done));
    spdlog::info("migration: resuming the paused postcopy via {}", addr.uri());
    return {};
}

nlohmann::json OutgoingMigration::query() const
{
    using nlohmann::json;
    if (status_ == MigrationStatus::None) {
        return json::object();
    }
    json r = {{"status", migration_status_name(status_)}};
    if (status_ == MigrationStatus::PostcopyPaused ||
        status_ == MigrationStatus::PostcopyRecoverSetup) {
        MutexLock lk(shared_->resume_mu);
        r["error-desc"] = shared_->pause_error;
    }
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
    const auto &s = shared_->stats;
    bool done = status_ == MigrationStatus::Completed;
    r["setup-time"] = s.setup_time_ms.load();
    r["total-time"] = done ? s.total_time_ms.load() : ms_since(shared_->start_time);
    if (done || migration_in_postcopy(status_)) { // migrate_show_downtime()
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
        {"total", params_.ignore_shared ? 0 : total_bytes_}, // ram_bytes_total()
        {"duplicate", zero},
        {"zero", zero},
        {"zero-bytes", zero * TARGET_PAGE_SIZE},
        {"normal", normal},
        {"normal-bytes", normal * TARGET_PAGE_SIZE},
        {"dirty-pages-rate", s.dirty_pages_rate.load()},
        {"mbps", s.mbps.load()},
        {"dirty-sync-count", s.dirty_sync_count.load()},
        {"postcopy-requests", s.postcopy_requests.load()},
        {"page-size", TARGET_PAGE_SIZE},
        {"multifd-bytes", s.multifd_bytes.load()},
        {"pages-per-second", s.pages_per_second.load()},
        {"precopy-bytes", s.precopy_bytes.load()},
        {"downtime-bytes", s.downtime_bytes.load()},
        {"postcopy-bytes", s.postcopy_bytes.load()},
        {"dirty-sync-missed-zero-copy", s.zero_copy_missed.load()},
    };
    if (s.working_set) {
        // qmigd's own, on a parked VM's postcopy resume (x-: not QEMU's).
        r["ram"]["x-working-set-pages"] = s.working_set_pages.load();
        r["ram"]["x-working-set-requested"] = s.working_set_requested.load();
    }
    if (params_.xbzrle) {
        r["xbzrle-cache"] = {
            {"cache-size", params_.xbzrle_cache_size},
            {"bytes", s.xbzrle_bytes.load()},
            {"pages", s.xbzrle_pages.load()},
            {"cache-miss", s.xbzrle_cache_miss.load()},
            {"cache-miss-rate", s.xbzrle_cache_miss_rate.load()},
            {"encoding-rate", s.xbzrle_encoding_rate.load()},
            {"overflow", s.xbzrle_overflow.load()},
        };
    }
    return r;
}

} // namespace qmigd
