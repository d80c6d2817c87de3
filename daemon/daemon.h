// A qmigd daemon: one libuv loop with the QMP monitor, the RAM blocks and
// the migration of its role (source or destination).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <uv.h>

#include "daemon/dest/incoming.h"
#include "daemon/source/dirty_rate_commands.h"
#include "daemon/io/unique_fd.h"
#include "daemon/service/metrics_server.h"
#include "daemon/service/service_notify.h"
#include "daemon/loop_dispatcher.h"
#include "daemon/source/outgoing.h"
#include "daemon/park/parked_vm.h"
#include "daemon/park/working_set.h"
#include "daemon/ram_blocks.h"
#include "monitor/migration_config.h"
#include "monitor/monitor_fds.h"
#include "monitor/qmp_server.h"

namespace qmigd {

enum class Role { Source, Destination };

struct DaemonOptions {
    Role role = Role::Source;
    std::string qmp_path;
    std::vector<std::string> ram_specs;
    // A parked VM's directory instead of --ram (daemon/park/parked_vm.h).
    std::string ram_dir;
    // Source --ram-dir: the parked VM's working set on a postcopy resume.
    WorkingSetOptions working_set;
    std::string incoming = "defer"; // destination: a migration URI or defer
    std::string metrics;            // --metrics HOST:PORT: /metrics for Prometheus
    std::string machine_type = "none";
    Uuid uuid{};
    std::string control_path; // source: guest control record (default IMAGE.ctl)
    PagePathMode page_path = PagePathMode::Auto;
    // A channel whose peer acknowledges nothing for this long fails the
    // migration (dead link); 0 waits as long as the kernel does.
    unsigned link_timeout_ms = 30000;
    // Source: send buffer per channel to a destination on this host.
    unsigned local_send_buffer = 128 << 10;
    // --object specs (tls-creds-x509, authz-list), created at start.
    std::vector<std::string> objects;
    // Confinement once the start's files and sockets are open
    // (daemon/service/sandbox.h).
    std::string sandbox = "off";
    std::string chroot_dir;
    std::string runas;
};

class Daemon {
public:
    explicit Daemon(DaemonOptions opts);
    // Opens the RAM blocks and the monitor, then serves until quit.
    ~Daemon();

    // Opens RAM, starts the monitor; then runs the loop until quit.
    Status run();

private:
    // start_steps(), and on a failure the image files it created removed.
    Status start();
    Status start_steps();
    Status open_ram();
    void register_commands();
    void register_migration_commands();
    void register_vm_commands();
    // yank_commands.cpp: query-yank and yank.
    void register_yank_commands();
    bool yank_migration_registered() const;
    json query_yank() const;
    QmpResult cmd_yank(const json &args);
    // migration_mode.cpp: the parameter `mode` (normal, cpr-reboot,
    // cpr-transfer) at migrate and migrate-incoming.
    const std::string &migration_mode() const;
    std::optional<QmpError> check_mode_channels(const MigrationAddress &addr,
                                                const json &args) const;
    std::optional<QmpError> check_mode_migrate(const json &args) const;
    std::optional<QmpError> check_mode_incoming() const;
    void on_migration_status(MigrationStatus s);
    void on_pass(uint64_t n);
    QmpResult cmd_migrate(const json &args);
    QmpResult cmd_migrate_incoming(const json &args);
    QmpResult start_incoming(const Result<MigrationAddress> &addr);
    Status start_incoming_option(const Result<MigrationAddress> &addr);
    std::optional<QmpError> check_address(const Result<MigrationAddress> &addr) const;
    // tls-creds, tls-hostname and tls-authz for a migration over `addr`.
    Result<TlsParams> tls_params(TlsCreds::Endpoint endpoint, const MigrationAddress &addr) const;
    MigrationStatus migration_status() const;
    json query_status() const;
    void shutdown();

    DaemonOptions opts_;
    uv_loop_t loop_;
    std::unique_ptr<LoopDispatcher> dispatcher_;
    std::unique_ptr<QmpServer> qmp_;
    std::unique_ptr<MonitorFds> fds_; // getfd/closefd, for fd: URIs
    MigrationConfig config_;
    TlsObjects objects_; // object-add: tls-creds-x509, authz-list
    std::vector<RAMBlock> blocks_;
    // Source --ram-dir: the parked VM it serves (read-only, shared with
    // each migration's parameters).
    std::shared_ptr<const ParkedVm> parked_;
    // Source: calc-dirty-rate's measurement over blocks_ (ended before them).
    std::unique_ptr<DirtyRateMeasure> dirty_rate_;
    std::unique_ptr<IncomingMigration> incoming_;
    std::unique_ptr<OutgoingMigration> outgoing_;
    std::string runstate_;        // QAPI RunState of this "VM"
    std::string runstate_before_; // source: run state before switchover
    std::unique_ptr<GuestControl> guest_; // source: the guest's control record
    bool autostart_ = true; // destination: run once the migration is in
    uv_signal_t sigint_, sigterm_;
    bool shutting_down_ = false;
    // A service manager's notify socket (daemon/service/service_notify.h):
    // readiness, the migration's state, the watchdog's pings.
    std::unique_ptr<ServiceNotifier> notify_;
    uv_timer_t watchdog_;
    bool watchdog_on_ = false;
    void notify_status(MigrationStatus s);
    // --metrics (daemon_metrics.cpp): the server, and the last finished
    // migration's query-migrate kept for it. Loop thread.
    std::unique_ptr<MetricsServer> metrics_;
    json last_query_ = json::object();
    double last_end_unix_ = 0;
    UniqueFd proc_status_fd_; // /proc/self/status, opened before --chroot/--runas
    Status start_metrics();
    std::string metrics_text() const;
    void keep_last_migration(MigrationStatus s);
    void start_watchdog();
};

} // namespace qmigd
