// The migration commands of the monitor: migrate, migrate-incoming and
// what steers a running migration (cancel, postcopy, pause, recover,
// continue), and the capabilities and parameters they start with.
#include "daemon/daemon.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/io/migration_address.h"
#include "monitor/qapi_visit.h"

namespace qmigd {

namespace {

// QEMU 10's argument types of the migration commands (qapi/migration.json,
// members in its order); the monitor checks them before a handler runs.
const QapiType kMigrateArgs = qapi_struct({{"uri", &kQapiStr, true},
                                           {"channels", &migration_channel_list_type(), true},
                                           {"detach", &kQapiBool, true},
                                           {"resume", &kQapiBool, true}});
const QapiType kMigrateIncomingArgs =
    qapi_struct({{"uri", &kQapiStr, true},
                 {"channels", &migration_channel_list_type(), true},
                 {"exit-on-error", &kQapiBool, true}});
const QapiType kMigrationStatusEnum = qapi_enum(
    {"none", "setup", "cancelling", "cancelled", "active", "postcopy-active", "postcopy-paused",
     "postcopy-recover-setup", "postcopy-recover", "completed", "failed", "colo",
     "pre-switchover", "device", "wait-unplug"});
const QapiType kMigrateContinueArgs = qapi_struct({{"state", &kMigrationStatusEnum}});
const QapiType kMigrateRecoverArgs = qapi_struct({{"uri", &kQapiStr}});

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

// QEMU's order (argument types checked already): the address, then the
// state (migrate_prepare).
QmpResult Daemon::cmd_migrate(const json &args)
{
    auto addr = migrate_address(args, false);
    if (auto e = check_address(addr)) {
        return *e;
    }
    if (auto e = check_mode_channels(*addr, args)) {
        return *e;
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
    if (auto e = check_mode_migrate(args)) {
        return *e;
    }
    OutgoingParams p;
    p.multifd = config_.capability("multifd");
    p.channels = config_.multifd_channels();
    p.zpd = zero_page_detection_parse(config_.zero_page_detection());
    p.max_bandwidth = config_.max_bandwidth();
    p.downtime_limit_ms = config_.downtime_limit_ms();
    p.machine_type = opts_.machine_type;
    // A parked VM's own UUID (if its source sent one) names it in the multifd
    // handshakes, which a destination started with -uuid checks.
    p.uuid = opts_.uuid == Uuid{} && parked_ && parked_->uuid ? *parked_->uuid : opts_.uuid;
    p.parked = parked_;
    p.working_set = opts_.working_set;
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
    p.pause_before_switchover = config_.capability("pause-before-switchover");
    p.switchover_ack = config_.capability("switchover-ack");
    p.validate_uuid = config_.capability("validate-uuid");
    p.ignore_shared = config_.capability("x-ignore-shared");
    p.xbzrle = config_.capability("xbzrle");
    p.zero_copy = config_.capability("zero-copy-send");
    p.xbzrle_cache_size = config_.xbzrle_cache_size();
    p.stop_first = migration_mode() == "cpr-reboot";
    if (p.ignore_shared && parked_) {
        return qmp_error("qmigd: x-ignore-shared cannot resume a parked VM: its images stay "
                         "as parked, and the destination would map and change them");
    }
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

// The address parsed, and a transport that takes the multifd and
// mapped-ram configuration.
std::optional<QmpError> Daemon::check_address(const Result<MigrationAddress> &addr) const
{
    if (!addr) {
        return QmpError{"GenericError", addr.error().message()};
    }
    if (auto st = check_transport_for_multifd(*addr, config_.capability("multifd"),
                                              config_.capability("mapped-ram"));
        !st) {
        return QmpError{"GenericError", st.error().message()};
    }
    return std::nullopt;
}

QmpResult Daemon::start_incoming(const Result<MigrationAddress> &addr)
{
    if (auto e = check_address(addr)) {
        return *e;
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
    p.ignore_shared = config_.capability("x-ignore-shared");
    p.switchover_ack = config_.capability("switchover-ack");
    if (p.ignore_shared && !p.park_dir.empty()) {
        return qmp_error("qmigd: x-ignore-shared cannot park a VM: no page of its RAM would "
                         "come (the source's memory stays in its own file)");
    }
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

// QEMU's qmp_migrate_incoming (argument types checked already): started
// already, the role, then the address. exit-on-error is accepted, but
// qmigd never exits on a failed load: it reports `failed` and stays ready
// for the next one.
QmpResult Daemon::cmd_migrate_incoming(const json &args)
{
    if (incoming_ && migration_is_running(incoming_->status())) {
        return qmp_error("The incoming migration has already been started");
    }
    if (opts_.role == Role::Source) {
        return qmp_error("'-incoming' was not specified on the command line");
    }
    if (auto e = check_mode_incoming()) {
        return *e;
    }
    return start_incoming(migrate_address(args, true));
}

void Daemon::register_migration_commands()
{
    QmpServer &q = *qmp_;
    const QapiType *none = &kQapiNoArgs;
    q.register_command("migrate", &kMigrateArgs, [this](const json &a) { return cmd_migrate(a); });
    q.register_command("migrate-incoming", &kMigrateIncomingArgs,
                       [this](const json &a) { return cmd_migrate_incoming(a); });
    q.register_command("migrate_cancel", none, [this](const json &) -> QmpResult {
        // Once postcopy runs, the VM lives on both sides: the source cannot
        // take it back (qmp_migrate_cancel), and a destination that let go
        // would lose the pages it has not yet received.
        if ((outgoing_ && migration_in_postcopy(outgoing_->status())) ||
            (incoming_ && migration_in_postcopy(incoming_->status()))) {
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
    // qmp_migrate_continue(): the state argument is any MigrationStatus;
    // only the source's current one lets the migration go on.
    q.register_command("migrate-continue", &kMigrateContinueArgs,
                       [this](const json &a) -> QmpResult {
        const std::string &state = a["state"].get_ref<const std::string &>();
        MigrationStatus now = outgoing_ ? outgoing_->status() : MigrationStatus::None;
        if (state != migration_status_name(now)) {
            return qmp_error(std::string("Migration not in expected state: ") +
                             migration_status_name(now));
        }
        // A destination has no outgoing migration: its state is `none`,
        // and QEMU posts a semaphore nobody waits on ({}).
        if (outgoing_) {
            outgoing_->continue_switchover();
        }
        return json::object();
    });
    q.register_command("migrate-recover", &kMigrateRecoverArgs,
                       [this](const json &a) -> QmpResult {
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
    q.register_command("migrate-set-capabilities", &MigrationConfig::set_capabilities_args(),
                       [this](const json &a) -> QmpResult {
        bool running = migration_is_running(migration_status());
        if (running && opts_.role == Role::Source) {
            return qmp_error("There's a migration process in progress");
        }
        MigrationConfig next = config_;
        if (auto e = next.set_capabilities(a)) {
            return *e;
        }
        // migrate_caps_check(): once incoming started, only what its
        // channels are accepted by cannot be turned on (the running load
        // keeps the capabilities it started with).
        auto turned_on = [&](const char *c) { return next.capability(c) && !config_.capability(c); };
        if (running && turned_on("postcopy-preempt")) {
            return qmp_error("Postcopy preempt must be set before incoming starts");
        }
        if (running && turned_on("multifd")) {
            return qmp_error("Multifd must be set before incoming starts");
        }
        config_ = std::move(next);
        return json::object();
    });
    // Types by the monitor, ranges and combinations by MigrationConfig.
    q.register_command("migrate-set-parameters", &MigrationConfig::set_parameters_args(),
                       [this](const json &a) -> QmpResult {
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

} // namespace qmigd
