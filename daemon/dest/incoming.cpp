// The destination's loop-side state machine: migrate-incoming, cancel, the end, query-migrate.
#include "daemon/dest/incoming.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/socket_io.h"
#include "daemon/io/file_channel.h"
#include "daemon/thread_name.h"
#include "protocol/multifd_compress.h"
#include "protocol/wire.h"

namespace qmigd {


IncomingMigration::IncomingMigration(uv_loop_t *loop, LoopDispatcher &dispatcher,
                                     std::vector<RAMBlock> &blocks, OnStatus on_status)
    : loop_(loop), dispatcher_(dispatcher), blocks_(blocks), on_status_(std::move(on_status))
{
}

IncomingMigration::~IncomingMigration()
{
    stop_multifd_watch();
    if (run_) {
        run_->quit();
        // Quit or a signal mid-park: what is not a whole parked VM goes, as
        // after a cancel (the record, once written, is the commit).
        if (!params_.park_dir.empty() && !run_->park_committed()) {
            for (const std::string &path : run_->park_created()) {
                ::unlink(path.c_str());
            }
            park_discard();
        }
    }
    end_attempt();
}

void IncomingMigration::post_to_loop(std::function<void()> fn)
{
    dispatcher_.post([alive = std::weak_ptr<const bool>(alive_), fn = std::move(fn)] {
        if (alive.lock()) { // the loop thread destroys this object: no race
            fn();
        }
    });
}

void IncomingMigration::set_status(MigrationStatus s)
{
    status_ = s;
    on_status_(s);
}

Status IncomingMigration::start(const MigrationAddress &addr, const IncomingParams &params)
{
    if (migration_is_running(status_)) {
        return Error("The incoming migration has already been started");
    }
    if (params.postcopy_preempt && params.tls.enabled()) {
        return Error("qmigd: a destination takes postcopy-preempt without TLS only");
    }
    UniqueFd park_lock;
    if (!params.park_dir.empty()) {
        QMIGD_TRY(park_dir_check(params.park_dir));
        if (params.mapped_ram) {
            return Error("A VM cannot be parked from a mapped-ram file");
        }
        auto lock = park_dir_lock(params.park_dir);
        QMIGD_TRY(lock);
        park_lock = std::move(*lock);
    }
    // An attempt left by a migrate-incoming that failed to start (no
    // threads: finish() drops any other once they are joined) goes.
    if (run_) {
        end_attempt();
    }
    if (!params.park_dir.empty()) {
        // A park before this one left its VM's blocks here, whole in the
        // directory that VM was parked in: closed, never removed. This park
        // starts with none (its stream announces its own), so neither its
        // loader nor its cleanup takes that VM's blocks for its own.
        blocks_.clear();
    }
    params_ = params;
    outcome_ = Outcome{};
    // Each attempt's first such line is said (the tests wait for it).
    tls_failed_log_ = RateLimitedLog();
    ignored_log_ = RateLimitedLog();
    run_ = std::make_shared<IncomingAttempt>(static_cast<IncomingOwner &>(*this), params_, blocks_);
    run_->claim_park_dir(std::move(park_lock));
    // A mapped-ram file has no channels to accept: its readers are threads.
    bool sockets = addr.transport == MigrationAddress::Transport::Socket;
    run_->expect_multifd(params.multifd && sockets ? params.channels : 0);
    for (auto &b : blocks_) {
        b.image->scan_holes();
    }
    if (addr.transport != MigrationAddress::Transport::Socket) {
        // The stream is one file or pipe: the main channel at once.
        std::shared_ptr<CommandChild> child;
        auto opened = open_one_channel(loop_, addr, false, params.tls.enabled(), fd_source_,
                                       &child);
        run_->set_child(std::move(child));
        QMIGD_TRY(opened);
        UniqueFd fd = std::move(*opened);
        if (params.mapped_ram) {
            QMIGD_TRY(open_mapped_ram(addr, fd.get()));
        }
        set_status(MigrationStatus::Setup);
        if (params_.tls.enabled()) {
            // fd: (a socket libvirt connected and handed over) or exec:
            // with TLS: the handshake first, as for a listener's connection.
            handshake_on_thread(std::move(fd), {});
            return {};
        }
        run_->set_main({std::make_unique<Channel>(std::move(fd)), {}});
        maybe_start();
        return {};
    }
    listener_ = std::make_unique<SocketListener>(
        loop_, 4, [this](PendingConnection *c) { on_prefix(c); },
        stranger_limits());
    listener_->set_on_accept([this](PendingConnection *c) { return take_preempt(c); });
    QMIGD_TRY(listener_->listen(addr.socket, [this](const Status &st) { listening(st); }));
    set_status(MigrationStatus::Setup);
    if (listener_->resolving()) {
        spdlog::info("incoming migration: resolving {} to listen on", addr.socket.host);
    } else {
        listening({});
    }
    return {};
}

void IncomingMigration::cancel()
{
    if (!migration_is_running(status_)) {
        return;
    }
    if (!run_->request_cancel()) {
        // QEMU's migrate_cancel answers nothing either way.
        spdlog::info("incoming migration: migrate_cancel came as the parked VM was being "
                     "committed: too late, the park completes");
        return;
    }
    spdlog::info("incoming migration: cancelled by migrate_cancel");
    if (loading()) {
        run_->abort_with(Error("migration cancelled")); // finish() reports it
        return;
    }
    end_attempt(); // still listening: nothing else runs
    set_status(MigrationStatus::Cancelled);
}

void IncomingMigration::fail_setup(const Error &why)
{
    Error err = with_ignored(why);
    spdlog::error("incoming migration failed: {}", err.message());
    outcome_.error_desc = err.message();
    end_attempt();
    set_status(MigrationStatus::Failed);
}

void IncomingMigration::maybe_start()
{
    if (!run_->channels_complete()) {
        return;
    }
    stop_multifd_watch();
    set_status(MigrationStatus::Active);
    if (run_->multifd_expected() == 0) {
        spdlog::info("incoming migration: main channel connected");
    } else {
        spdlog::info("incoming migration: main channel and {} multifd channels connected",
                     run_->multifd_expected());
    }
    run_->start_load();
}

void IncomingMigration::finish(std::optional<Error> err, std::string runstate)
{
    run_->join_load();
    bool cancelled = run_->cancel_requested();
    end_attempt();
    if ((cancelled || err) && !params_.park_dir.empty()) {
        park_discard();
    }
    if (cancelled) {
        set_status(MigrationStatus::Cancelled);
        return;
    }
    if (err) {
        err = with_ignored(*err);
        spdlog::error("incoming migration failed: {}", err->message());
        outcome_.error_desc = err->message();
        set_status(MigrationStatus::Failed);
        return;
    }
    outcome_.runstate = runstate;
    spdlog::info("incoming migration completed: {} normal pages, {} zero pages, {} bytes "
                 "received",
                 outcome_.counts.normal, outcome_.counts.zero, outcome_.counts.bytes);
    set_status(MigrationStatus::Completed);
}

void IncomingMigration::end_attempt()
{
    if (run_) {
        run_->end_preempt();
    }
    cleanup_channels();
    if (run_) {
        outcome_.counts = run_->counts();
        // Its threads are joined: its channels close with it (an exec:
        // command gets EOF or EPIPE and ends; it is reaped on the loop
        // whenever it does).
        run_.reset();
    }
}

bool IncomingMigration::current(const std::weak_ptr<IncomingAttempt> &run) const
{
    auto r = run.lock();
    return r && r == run_;
}

void IncomingMigration::post_end(std::weak_ptr<IncomingAttempt> run, std::optional<Error> err,
                                 std::string runstate, std::optional<ParkedVm> parked)
{
    post_to_loop([this, run, err = std::move(err), runstate = std::move(runstate),
                  parked = std::move(parked)]() mutable {
        if (!current(run)) {
            return; // not the current attempt's end (start() joins first: never)
        }
        outcome_.parked = std::move(parked);
        finish(err, runstate);
    });
}

void IncomingMigration::post_status(std::weak_ptr<IncomingAttempt> run, MigrationStatus from,
                                    MigrationStatus to)
{
    post_to_loop([this, run, from, to] {
        if (current(run) && status_ == from) {
            set_status(to);
        }
    });
}

// blocks_ is the daemon's list, which the loop reads (a /metrics scrape
// lists its blocks): the loop appends the new ones, and the load thread
// reads the list once it has (blocks_arrived() under park_mu_ orders the two).
void IncomingMigration::post_blocks(std::shared_ptr<IncomingAttempt> run,
                                    std::vector<RAMBlock> made)
{
    auto holder = std::make_shared<std::vector<RAMBlock>>(std::move(made));
    post_to_loop([this, run, holder] {
        for (auto &b : *holder) {
            blocks_.push_back(std::move(b));
        }
        run->blocks_arrived();
    });
}

void IncomingMigration::post_pause(std::weak_ptr<IncomingAttempt> run)
{
    post_to_loop([this, run] {
        if (current(run) && (status_ == MigrationStatus::PostcopyActive ||
                                   status_ == MigrationStatus::PostcopyRecover)) {
            pause();
        }
    });
}

void IncomingMigration::park_discard()
{
    for (size_t i = 0; i < blocks_.size(); i++) {
        ::unlink(parked_block_path(params_.park_dir, i, blocks_[i].desc.idstr).c_str());
    }
    blocks_.clear();
    outcome_.parked.reset();
}

nlohmann::json IncomingMigration::query() const
{
    using nlohmann::json;
    if (status_ == MigrationStatus::None) {
        return json::object();
    }
    json r = {{"status", migration_status_name(status_)}};
    if (listener_ && listener_->listening()) {
        r["socket-address"] = json::array({socket_address_json(listener_->address())});
    }
    if (status_ == MigrationStatus::Failed && !outcome_.error_desc.empty()) {
        r["error-desc"] = outcome_.error_desc;
    }
    // qmigd addition: what the destination received (live while it runs).
    IncomingCounts n = run_ ? run_->counts() : outcome_.counts;
    r["incoming"] = {{"normal", n.normal}, {"zero", n.zero}, {"bytes", n.bytes}};
    const std::optional<ParkedVm> &parked = outcome_.parked;
    if (parked && status_ == MigrationStatus::Completed) {
        json blocks = json::array();
        for (const auto &b : parked->blocks) {
            blocks.push_back({{"id", b.idstr}, {"size", b.size}});
        }
        r["parked"] = {{"dir", parked->dir},
                       {"machine-type", parked->machine_type},
                       {"blocks", blocks},
                       {"device-state-bytes", parked->device_state_bytes}};
    }
    return r;
}

} // namespace qmigd
