// The daemon: its loop, monitor, role objects and the state QMP and HMP read.
#include "daemon/daemon.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/migration_threads.h"
#include "daemon/service/sandbox.h"
#include "protocol/wire.h"
#include "monitor/hmp.h"
#include "monitor/qapi_visit.h"

namespace qmigd {

Daemon::Daemon(DaemonOptions opts) : opts_(std::move(opts))
{
    uv_loop_init(&loop_);
    runstate_ = opts_.role == Role::Destination ? "inmigrate" : "running";
}

Daemon::~Daemon()
{
    incoming_.reset();
    outgoing_.reset();
    uv_run(&loop_, UV_RUN_DEFAULT);
    uv_loop_close(&loop_);
}

MigrationStatus Daemon::migration_status() const
{
    if (incoming_) {
        return incoming_->status();
    }
    return outgoing_ ? outgoing_->status() : MigrationStatus::None;
}

void Daemon::on_migration_status(MigrationStatus s)
{
    notify_status(s);
    keep_last_migration(s);
    if (opts_.role == Role::Source) {
        // The VM stops before pre-switchover (pause-before-switchover) or
        // device, once.
        if ((s == MigrationStatus::Device || s == MigrationStatus::PreSwitchover) &&
            runstate_ != "finish-migrate") {
            if (runstate_ == "running") {
                qmp_->emit_event("STOP");
            }
            runstate_before_ = runstate_;
            runstate_ = "finish-migrate";
        } else if (s == MigrationStatus::Completed) {
            runstate_ = "postmigrate"; // the guest stays paused
        } else if ((s == MigrationStatus::Failed || s == MigrationStatus::Cancelled) &&
                   outgoing_->vm_handed_over()) {
            runstate_ = "postmigrate"; // the VM may run at the destination now
        } else if ((s == MigrationStatus::Failed || s == MigrationStatus::Cancelled) &&
                   runstate_ == "finish-migrate") {
            // As QEMU: a VM stopped for switchover runs again.
            runstate_ = runstate_before_;
            if (runstate_ == "running") {
                if (guest_) {
                    guest_->resume();
                }
                qmp_->emit_event("RESUME");
            }
        }
    } else if (s == MigrationStatus::Completed) {
        runstate_ = incoming_->runstate();
        if (runstate_ == "running" && !autostart_) {
            runstate_ = "paused";
        }
        if (runstate_ == "running") {
            qmp_->emit_event("RESUME");
        }
    }
    if (config_.capability("events")) {
        qmp_->emit_event("MIGRATION", {{"status", migration_status_name(s)}});
    }
}

void Daemon::on_pass(uint64_t n)
{
    if (config_.capability("events")) {
        qmp_->emit_event("MIGRATION_PASS", {{"pass", n}});
    }
}

json Daemon::query_status() const
{
    return {{"status", runstate_}, {"running", runstate_ == "running"}};
}


void Daemon::register_vm_commands()
{
    QmpServer &q = *qmp_;
    const QapiType *none = &kQapiNoArgs;
    q.register_command("query-status", none, [this](const json &) -> QmpResult { return query_status(); });
    q.register_command("query-version", none, [](const json &) -> QmpResult {
        return json{{"qemu", {{"micro", 2}, {"minor", 0}, {"major", 10}}},
                    {"package", "qmigd " QMIGD_VERSION}};
    });
    q.register_command("query-commands", none, [this](const json &) -> QmpResult {
        json list = json::array({{{"name", "qmp_capabilities"}}});
        for (const auto &n : qmp_->command_names()) {
            list.push_back({{"name", n}});
        }
        return list;
    });
    q.register_command("stop", none, [this](const json &) -> QmpResult {
        if (runstate_ == "inmigrate") { // as QEMU: do not start after the migration
            autostart_ = false;
            return json::object();
        }
        if (runstate_ == "running") {
            if (guest_) {
                if (auto st = guest_->pause(std::chrono::seconds(5)); !st) {
                    guest_->resume();
                    return qmp_error(st.error().message());
                }
            }
            runstate_ = "paused";
            if (outgoing_) {
                outgoing_->set_vm_running(false);
            }
            qmp_->emit_event("STOP");
        }
        return json::object();
    });
    q.register_command("cont", none, [this](const json &) -> QmpResult {
        if (runstate_ == "inmigrate") { // as QEMU: start once the migration is in
            autostart_ = true;
            return json::object();
        }
        if (runstate_ == "finish-migrate") {
            return qmp_error("The VM is stopped for the end of a migration");
        }
        if (runstate_ != "running") {
            if (guest_) {
                guest_->resume();
            }
            runstate_ = "running";
            if (outgoing_) {
                outgoing_->set_vm_running(true);
            }
            qmp_->emit_event("RESUME");
        }
        return json::object();
    });
    q.register_command("quit", none, [this](const json &) -> QmpResult {
        // Reply first; shut down on the next loop turn.
        dispatcher_->post([this] { shutdown(); });
        return json::object();
    });
}

// QEMU's migrate_tls_creds() & co.: an empty tls-creds means no TLS. The
// name a server certificate must carry is tls-hostname, else the URI's
// host (QEMU's s->hostname).
Result<TlsParams> Daemon::tls_params(TlsCreds::Endpoint endpoint,
                                     const MigrationAddress &addr) const
{
    const json &params = config_.parameters();
    std::string id = params["tls-creds"];
    TlsParams t;
    if (id.empty()) {
        return t;
    }
    // QEMU upgrades any channel; a handshake needs both directions, which
    // a file does not have.
    if (addr.transport == MigrationAddress::Transport::File) {
        return Error("qmigd: TLS is not available on file: migration");
    }
    auto creds = objects_.creds(id, endpoint);
    QMIGD_TRY(creds);
    t.creds = *creds;
    t.hostname = params["tls-hostname"];
    if (t.hostname.empty() && addr.socket.type == SocketAddress::Type::Inet) {
        t.hostname = addr.socket.host;
    }
    std::string authz = params["tls-authz"];
    if (endpoint == TlsCreds::Endpoint::Server && !authz.empty()) {
        auto a = objects_.authz(authz);
        QMIGD_TRY(a);
        t.authz = *a;
    }
    return t;
}

namespace {

const QapiType kObjectDelArgs = qapi_struct({{"id", &kQapiStr}});

} // namespace

void Daemon::register_commands()
{
    // object-add: TlsObjects checks ObjectOptions (--object takes that way too).
    qmp_->register_command("object-add", nullptr, [this](const json &a) -> QmpResult {
        if (auto st = objects_.add(a); !st) {
            return qmp_error(st.error().message());
        }
        return json::object();
    });
    qmp_->register_command("object-del", &kObjectDelArgs, [this](const json &a) -> QmpResult {
        if (auto st = objects_.del(a["id"]); !st) {
            return qmp_error(st.error().message());
        }
        return json::object();
    });
    register_migration_commands();
    register_vm_commands();
    register_migration_threads_command(*qmp_);
    if (opts_.role == Role::Source) {
        dirty_rate_ = register_dirty_rate_commands(*qmp_, blocks_);
    }
    register_yank_commands();
    hmp_register(*qmp_, [](const std::string &uri) -> std::optional<std::string> {
        auto addr = parse_migration_uri(uri);
        return addr ? std::nullopt : std::optional<std::string>(addr.error().message());
    });
}

void Daemon::shutdown()
{
    if (shutting_down_) {
        return;
    }
    shutting_down_ = true;
    spdlog::info("shutting down");
    if (notify_) {
        notify_->send("STOPPING=1");
    }
    if (watchdog_on_) {
        uv_close(reinterpret_cast<uv_handle_t *>(&watchdog_), nullptr);
    }
    if (metrics_) {
        metrics_->stop();
    }
    qmp_->emit_event("SHUTDOWN", {{"guest", false}, {"reason", "host-qmp-quit"}});
    if (outgoing_) {
        outgoing_->cancel();
    }
    qmp_->close();
    dispatcher_->close();
    uv_close(reinterpret_cast<uv_handle_t *>(&sigint_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t *>(&sigterm_), nullptr);
    uv_stop(&loop_);
}

// STATUS= for `systemctl status`: the role and the migration's state.
void Daemon::notify_status(MigrationStatus s)
{
    if (notify_) {
        notify_->send(fmt::format("STATUS={}: migration {}",
                                  opts_.role == Role::Source ? "source" : "destination",
                                  migration_status_name(s)));
    }
}

Status Daemon::run()
{
    // Before anything can start a command (exec:): it must not inherit it.
    notify_ = ServiceNotifier::from_environment();
    Status st = start();
    if (!st) {
        // Close what start() opened, so ~Daemon's uv_run() returns.
        incoming_.reset();
        outgoing_.reset();
        if (qmp_) {
            qmp_->close();
        }
        if (dispatcher_) {
            dispatcher_->close();
        }
        return st;
    }
    spdlog::info("qmigd {} ready, QMP on {}",
                 opts_.role == Role::Source ? "source" : "destination", opts_.qmp_path);
    if (notify_) {
        notify_->send("READY=1");
        notify_status(migration_status());
        start_watchdog();
    }
    uv_run(&loop_, UV_RUN_DEFAULT);
    return {};
}

// WATCHDOG=1 at half the manager's interval, from the loop: a loop that
// stops turning stops the pings and the manager restarts the service.
void Daemon::start_watchdog()
{
    uint64_t usec = notify_->watchdog_usec();
    if (usec == 0) {
        return;
    }
    uint64_t ms = std::max<uint64_t>(1, usec / 2000);
    uv_timer_init(&loop_, &watchdog_);
    watchdog_.data = this;
    uv_timer_start(
        &watchdog_,
        [](uv_timer_t *t) { static_cast<Daemon *>(t->data)->notify_->send("WATCHDOG=1"); }, 0,
        ms);
    watchdog_on_ = true;
    spdlog::info("service watchdog: a ping every {} ms", ms);
}

// --ram, or --ram-dir: a destination parks there (its blocks come with the
// stream); a source serves the VM parked there, with its machine type.
Status Daemon::open_ram()
{
    if (opts_.ram_specs.empty() == opts_.ram_dir.empty()) {
        return Error("give --ram or --ram-dir");
    }
    if (!opts_.ram_dir.empty() && opts_.role == Role::Destination) {
        // Parks are written as --runas's user: the directory must be theirs
        // to write, or the first park fails half-way (Permission denied).
        QMIGD_TRY(dir_for_user(opts_.ram_dir, opts_.runas));
        return park_dir_check(opts_.ram_dir);
    }
    if (!opts_.ram_dir.empty()) {
        auto vm = parked_vm_read(opts_.ram_dir);
        QMIGD_TRY(vm);
        for (const auto &spec : parked_vm_ram_specs(*vm)) {
            auto b = ram_block_open(spec, true, opts_.page_path);
            QMIGD_TRY(b);
            blocks_.push_back(std::move(*b));
        }
        spdlog::info("parked VM '{}' in {}: {} RAM blocks, {} bytes of device state",
                     wire_text(vm->machine_type), opts_.ram_dir, vm->blocks.size(),
                     vm->device_state.size());
        opts_.machine_type = vm->machine_type;
        parked_ = std::make_shared<const ParkedVm>(std::move(*vm));
        return {};
    }
    auto blocks = ram_blocks_open(opts_.ram_specs, opts_.role == Role::Source, opts_.page_path);
    QMIGD_TRY(blocks);
    blocks_ = std::move(*blocks);
    return {};
}

// The soft descriptor limit up to the hard one: a destination holds up to
// a few hundred strangers' connections at once (their number is bounded,
// daemon/io/socket_channels.h), beside its channels and monitor clients.
static void raise_fd_limit()
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

// --incoming: migrate-incoming's answer, as a start error.
Status Daemon::start_incoming_option(const Result<MigrationAddress> &addr)
{
    auto r = start_incoming(addr);
    if (auto *e = std::get_if<QmpError>(&r)) {
        return Error(e->desc);
    }
    return {};
}

Status Daemon::start()
{
    Status st = start_steps();
    if (!st) {
        ram_blocks_remove_created(blocks_);
    }
    return st;
}

Status Daemon::start_steps()
{
    raise_fd_limit();
    SandboxOptions sandbox;
    QMIGD_TRY(sandbox_parse(opts_.sandbox, &sandbox));
    QMIGD_TRY(open_ram());
    for (const auto &spec : opts_.objects) {
        QMIGD_TRY(objects_.add_option(spec));
    }
    dispatcher_ = std::make_unique<LoopDispatcher>(&loop_);
    qmp_ = std::make_unique<QmpServer>(&loop_);
    fds_ = std::make_unique<MonitorFds>(*qmp_);
    auto on_status = [this](MigrationStatus s) { on_migration_status(s); };
    if (opts_.role == Role::Destination) {
        incoming_ = std::make_unique<IncomingMigration>(&loop_, *dispatcher_, blocks_, on_status);
        incoming_->set_fd_source([this](const std::string &n) { return fds_->take(n, true); });
    } else {
        const RamImage &first = *blocks_.front().image;
        // A parked VM has no guest to control, and its directory is not
        // written: its control record lives in memory.
        SideFile ctl = parked_ ? SideFile{"", SideFileName::Anonymous}
                               : side_file(opts_.control_path, first.path(), first.backing(),
                                           ".ctl");
        auto gc = GuestControl::open(ctl.path, ctl.name);
        QMIGD_TRY(gc);
        guest_ = std::move(*gc);
        outgoing_ = std::make_unique<OutgoingMigration>(&loop_, *dispatcher_, blocks_,
                                                        guest_.get(), on_status,
                                                        [this](uint64_t n) { on_pass(n); });
        outgoing_->set_fd_source([this](const std::string &n) { return fds_->take(n, false); });
    }
    register_commands();
    QMIGD_TRY(qmp_->listen(opts_.qmp_path));
    QMIGD_TRY(start_metrics());
    // A port is bound before the privileges go (it may be below 1024); an
    // exec: command starts after the filter, so that it runs confined (with
    // spawn=allow: it inherits the deny-list; spawn=deny refuses it).
    auto incoming = parse_migration_uri(opts_.incoming);
    bool at_start = opts_.role == Role::Destination && opts_.incoming != "defer";
    bool exec = incoming && incoming->transport == MigrationAddress::Transport::Exec;
    if (at_start && incoming && incoming->transport == MigrationAddress::Transport::Socket) {
        // Before READY=1 the port must listen: the name is looked up here,
        // where no loop is running yet to stall.
        QMIGD_TRY(resolve_listen_host(&incoming->socket));
    }
    if (at_start && !exec) {
        QMIGD_TRY(start_incoming_option(incoming));
    }
    // Confined once what the start opens is open (daemon/service/sandbox.h).
    QMIGD_TRY(drop_privileges(opts_.chroot_dir, opts_.runas));
    QMIGD_TRY(sandbox_install(sandbox));
    if (at_start && exec) {
        QMIGD_TRY(start_incoming_option(incoming));
    }
    uv_signal_init(&loop_, &sigint_);
    uv_signal_init(&loop_, &sigterm_);
    sigint_.data = sigterm_.data = this;
    auto on_signal = [](uv_signal_t *h, int) { static_cast<Daemon *>(h->data)->shutdown(); };
    uv_signal_start(&sigint_, on_signal, SIGINT);
    uv_signal_start(&sigterm_, on_signal, SIGTERM);
    return {};
}

} // namespace qmigd
