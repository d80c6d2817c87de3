#include "daemon/daemon.h"

#include <sys/resource.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "monitor/hmp.h"

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
    if (opts_.role == Role::Source) {
        if (s == MigrationStatus::Device) {
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

namespace {

// What QEMU's QAPI visitor checks of migrate's and migrate-incoming's
// arguments before the command runs, in its order.
std::optional<QmpError> check_migrate_args(const json &args,
                                           std::initializer_list<const char *> flags)
{
    if (args.contains("uri") && !args["uri"].is_string()) {
        return QmpError{"GenericError", "Invalid parameter type for 'uri', expected: string"};
    }
    if (args.contains("channels")) {
        if (auto e = qapi_check(args["channels"], migration_channel_list_type(), "channels",
                                "channels")) {
            return e;
        }
    }
    for (const char *name : flags) {
        if (args.contains(name) && !args[name].is_boolean()) {
            return QmpError{"GenericError", fmt::format("Invalid parameter type for '{}', "
                                                        "expected: boolean", name)};
        }
    }
    return std::nullopt;
}

// The address of a migrate or migrate-incoming: `uri` or `channels`
// (an empty list counts as none), with QEMU's errors.
Result<MigrationAddress> migrate_address(const json &args, bool incoming)
{
    bool has_channels = args.contains("channels") && !args["channels"].empty();
    if (args.contains("uri") == has_channels) {
        return Error("need either 'uri' or 'channels' argument");
    }
    return has_channels ? migration_channels_address(args["channels"], incoming)
                        : parse_migration_uri(args["uri"]);
}

} // namespace

// QEMU's order: argument types, then the address, then the state
// (migrate_prepare).
QmpResult Daemon::cmd_migrate(const json &args)
{
    if (auto e = check_migrate_args(args, {"detach", "resume"})) {
        return *e;
    }
    auto addr = migrate_address(args, false);
    if (!addr) {
        return qmp_error(addr.error().message());
    }
    if (auto st = check_transport_for_multifd(*addr, config_.capability("multifd"),
                                              config_.capability("mapped-ram"));
        !st) {
        return qmp_error(st.error().message());
    }
    if (args.value("resume", false)) {
        // migrate_prepare(): only a paused postcopy resumes.
        if (opts_.role == Role::Destination) {
            return qmp_error("Cannot resume if there is no paused migration");
        }
        if (auto st = outgoing_->resume(*addr); !st) {
            return qmp_error(st.error().message());
        }
        return json::object();
    }
    // A destination's own outgoing state is never running: QEMU's next
    // check, the run state, is what it reports.
    if (opts_.role == Role::Destination) {
        return qmp_error("Guest is waiting for an incoming migration");
    }
    auto compression = multifd_compression_parse(config_.multifd_compression());
    if (config_.capability("mapped-ram") && compression != MultiFDCompression::None) {
        return qmp_error("Cannot use compression with mapped-ram");
    }
    if (migration_is_running(migration_status())) {
        return qmp_error("There's a migration process in progress");
    }
    if (runstate_ == "postmigrate") {
        return qmp_error("Can't migrate the vm that was paused due to previous migration");
    }
    OutgoingParams p;
    p.multifd = config_.capability("multifd");
    p.channels = config_.multifd_channels();
    p.zpd = zero_page_detection_parse(config_.zero_page_detection());
    p.max_bandwidth = config_.max_bandwidth();
    p.downtime_limit_ms = config_.downtime_limit_ms();
    p.machine_type = opts_.machine_type;
    p.uuid = opts_.uuid;
    p.parked = parked_;
    p.runstate = runstate_;
    p.auto_converge = config_.capability("auto-converge");
    p.throttle_initial = config_.cpu_throttle_initial();
    p.throttle_increment = config_.cpu_throttle_increment();
    p.max_throttle = config_.max_cpu_throttle();
    p.throttle_trigger_threshold = config_.parameters()["throttle-trigger-threshold"];
    p.link_timeout_ms = opts_.link_timeout_ms;
    p.local_send_buffer = opts_.local_send_buffer;
    p.mapped_ram = config_.capability("mapped-ram");
    p.direct_io = config_.direct_io();
    p.return_path = config_.capability("return-path");
    p.postcopy_ram = config_.capability("postcopy-ram");
    p.postcopy_preempt = config_.capability("postcopy-preempt");
    p.max_postcopy_bandwidth = config_.max_postcopy_bandwidth();
    p.compression = {*compression, config_.multifd_compression_level()};
    auto tls = tls_params(TlsCreds::Endpoint::Client, *addr);
    if (tls) {
        p.tls = *tls;
    } else {
        p.tls_error = tls.error();
    }
    if (auto st = outgoing_->start(*addr, p); !st) {
        return qmp_error(st.error().message());
    }
    return json::object();
}

QmpResult Daemon::start_incoming(const Result<MigrationAddress> &addr)
{
    if (!addr) {
        return qmp_error(addr.error().message());
    }
    if (auto st = check_transport_for_multifd(*addr, config_.capability("multifd"),
                                              config_.capability("mapped-ram"));
        !st) {
        return qmp_error(st.error().message());
    }
    IncomingParams p;
    p.multifd = config_.capability("multifd");
    p.channels = config_.multifd_channels();
    p.uuid = opts_.uuid;
    p.machine_type = opts_.machine_type;
    p.link_timeout_ms = opts_.link_timeout_ms;
    p.mapped_ram = config_.capability("mapped-ram");
    p.direct_io = config_.direct_io();
    p.compression = *multifd_compression_parse(config_.multifd_compression());
    p.park_dir = opts_.ram_dir;
    p.postcopy_ram = config_.capability("postcopy-ram");
    p.postcopy_preempt = config_.capability("postcopy-preempt");
    auto tls = tls_params(TlsCreds::Endpoint::Server, *addr);
    if (!tls) {
        return qmp_error(tls.error().message());
    }
    p.tls = *tls;
    runstate_ = "inmigrate";
    if (auto st = incoming_->start(*addr, p); !st) {
        return qmp_error(st.error().message());
    }
    return json::object();
}

// QEMU's qmp_migrate_incoming: argument types, started already, the role,
// then the address. exit-on-error is accepted, but qmigd never exits on a
// failed load: it reports `failed` and stays ready for the next one.
QmpResult Daemon::cmd_migrate_incoming(const json &args)
{
    if (auto e = check_migrate_args(args, {"exit-on-error"})) {
        return *e;
    }
    if (incoming_ && migration_is_running(incoming_->status())) {
        return qmp_error("The incoming migration has already been started");
    }
    if (opts_.role == Role::Source) {
        return qmp_error("'-incoming' was not specified on the command line");
    }
    return start_incoming(migrate_address(args, true));
}

void Daemon::register_migration_commands()
{
    QmpServer &q = *qmp_;
    using Members = std::vector<std::string>;
    const Members none;
    q.register_command("migrate", Members{"*uri", "*channels", "*detach", "*resume"},
                       [this](const json &a) { return cmd_migrate(a); });
    q.register_command("migrate-incoming", Members{"*uri", "*channels", "*exit-on-error"},
                       [this](const json &a) { return cmd_migrate_incoming(a); });
    q.register_command("migrate_cancel", none, [this](const json &) -> QmpResult {
        if (outgoing_ && migration_in_postcopy(outgoing_->status())) {
            // The source can no longer take the VM back (qmp_migrate_cancel).
            return qmp_error("Postcopy migration in progress, cannot cancel.");
        }
        if (outgoing_) {
            outgoing_->cancel();
        }
        if (incoming_) {
            incoming_->cancel();
        }
        return json::object();
    });
    q.register_command("migrate-start-postcopy", none, [this](const json &) -> QmpResult {
        if (!config_.capability("postcopy-ram")) {
            return qmp_error("Enable postcopy with migrate_set_capability before the start of "
                             "migration");
        }
        if (migration_status() == MigrationStatus::None) {
            return qmp_error("Postcopy must be started after migration has been started");
        }
        if (outgoing_) {
            outgoing_->start_postcopy();
        }
        return json::object();
    });
    q.register_command("migrate-pause", none, [this](const json &) -> QmpResult {
        if (outgoing_ && migration_postcopy_is_alive(outgoing_->status())) {
            outgoing_->pause();
            return json::object();
        }
        if (incoming_ && migration_postcopy_is_alive(incoming_->status())) {
            incoming_->pause();
            return json::object();
        }
        return qmp_error("migrate-pause is currently only supported during postcopy-active or "
                         "postcopy-recover state");
    });
    q.register_command("migrate-recover", std::vector<std::string>{"uri"},
                       [this](const json &a) -> QmpResult {
        if (!a["uri"].is_string()) {
            return qmp_error("Invalid parameter type for 'uri', expected: string");
        }
        if (!incoming_ || incoming_->status() != MigrationStatus::PostcopyPaused) {
            return qmp_error("Migrate recover can only be run when postcopy is paused.");
        }
        auto addr = parse_migration_uri(a["uri"]);
        if (!addr) {
            return qmp_error(addr.error().message());
        }
        if (auto st = incoming_->recover(*addr); !st) {
            return qmp_error(st.error().message());
        }
        return json::object();
    });
    q.register_command("query-migrate", none, [this](const json &) -> QmpResult {
        return incoming_ ? incoming_->query() : outgoing_->query();
    });
    q.register_command("query-migrate-capabilities", none,
                       [this](const json &) -> QmpResult { return config_.capabilities(); });
    q.register_command("query-migrate-parameters", none,
                       [this](const json &) -> QmpResult { return config_.parameters(); });
    q.register_command("migrate-set-capabilities", Members{"capabilities"}, [this](const json &a) -> QmpResult {
        if (migration_is_running(migration_status())) {
            return qmp_error(opts_.role == Role::Destination
                                 ? "Multifd must be set before incoming starts"
                                 : "There's a migration process in progress");
        }
        if (auto e = config_.set_capabilities(a)) {
            return *e;
        }
        return json::object();
    });
    // Parameters are checked one by one, with QEMU's texts, by MigrationConfig.
    q.register_command("migrate-set-parameters", std::nullopt, [this](const json &a) -> QmpResult {
        if (auto e = config_.set_parameters(a)) {
            return *e;
        }
        if (outgoing_ && a.contains("max-bandwidth")) {
            outgoing_->set_max_bandwidth(config_.max_bandwidth());
        }
        if (outgoing_ && a.contains("max-postcopy-bandwidth")) {
            outgoing_->set_max_postcopy_bandwidth(config_.max_postcopy_bandwidth());
        }
        return json::object();
    });
}

void Daemon::register_vm_commands()
{
    QmpServer &q = *qmp_;
    const std::vector<std::string> none;
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

void Daemon::register_commands()
{
    const std::vector<std::string> id_only{"id"};
    qmp_->register_command("object-add", std::nullopt, [this](const json &a) -> QmpResult {
        if (auto st = objects_.add(a); !st) {
            return qmp_error(st.error().message());
        }
        return json::object();
    });
    qmp_->register_command("object-del", id_only, [this](const json &a) -> QmpResult {
        if (!a["id"].is_string()) {
            return qmp_error("Invalid parameter type for 'id', expected: string");
        }
        if (auto st = objects_.del(a["id"]); !st) {
            return qmp_error(st.error().message());
        }
        return json::object();
    });
    register_migration_commands();
    register_vm_commands();
    hmp_register(*qmp_);
}

void Daemon::shutdown()
{
    if (shutting_down_) {
        return;
    }
    shutting_down_ = true;
    spdlog::info("shutting down");
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

Status Daemon::run()
{
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
    uv_run(&loop_, UV_RUN_DEFAULT);
    return {};
}

// --ram, or --ram-dir: a destination parks there (its blocks come with the
// stream); a source serves the VM parked there, with its machine type.
Status Daemon::open_ram()
{
    if (opts_.ram_specs.empty() == opts_.ram_dir.empty()) {
        return Error("give --ram or --ram-dir");
    }
    if (!opts_.ram_dir.empty() && opts_.role == Role::Destination) {
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
                     vm->machine_type, opts_.ram_dir, vm->blocks.size(), vm->device_state.size());
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

Status Daemon::start()
{
    raise_fd_limit();
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
    if (opts_.role == Role::Destination && opts_.incoming != "defer") {
        auto r = start_incoming(parse_migration_uri(opts_.incoming));
        if (auto *e = std::get_if<QmpError>(&r)) {
            return Error(e->desc);
        }
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
