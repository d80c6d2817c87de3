// The source side of a migration: the main migration thread (QEMU's
// migration_thread + ram_save_setup/iterate/complete) driving multifd
// sender threads.
//
// Threads:
//  - loop thread: migrate / migrate_cancel / query-migrate, connects the
//    channels (libuv), receives status changes through the dispatcher.
//  - migration thread: owns the main channel, the dirty bitmaps' migration
//    copies and the multifd hand-off; publishes counters as atomics.
//  - multifd sender threads (multifd_send.h).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <uv.h>

#include "daemon/loop_dispatcher.h"
#include "daemon/migration_status.h"
#include "daemon/ram_blocks.h"
#include "daemon/io/command_channel.h"
#include "daemon/io/migration_address.h"
#include "daemon/io/socket_channels.h"
#include "daemon/tls/tls_creds.h"
#include "protocol/multifd_compress.h"
#include "ramstate/guest_control.h"
#include "ramstate/zero_page.h"

namespace qmigd {

struct OutgoingParams {
    bool multifd = false;
    unsigned channels = 2;
    ZeroPageDetection zpd = ZeroPageDetection::Multifd;
    uint64_t max_bandwidth = 0; // bytes/s, 0 = unlimited
    uint64_t downtime_limit_ms = 300;
    std::string machine_type = "none";
    Uuid uuid{};
    std::string runstate = "running"; // of the VM when the migration starts
    // auto-converge (QEMU's cpu throttling, applied through GuestControl).
    bool auto_converge = false;
    unsigned throttle_initial = 20;
    unsigned throttle_increment = 10;
    unsigned max_throttle = 99;
    unsigned throttle_trigger_threshold = 50;
    unsigned link_timeout_ms = 30000; // dead-link detection, 0 = never
    // mapped-ram (file: only): pages at fixed offsets; with multifd each
    // channel is a descriptor of the same file, O_DIRECT with direct_io.
    bool mapped_ram = false;
    bool direct_io = false;
    // multifd-compression (multifd channels only).
    MultiFDCompressionParams compression;
    // tls-creds (client endpoint), tls-hostname: every socket channel.
    TlsParams tls;
    // Why tls-creds cannot be used: QEMU looks the object up once the
    // migration runs, so the migration fails with this, not the command.
    std::optional<Error> tls_error;
};

class OutgoingMigration {
public:
    using OnStatus = std::function<void(MigrationStatus)>;
    using OnPass = std::function<void(uint64_t)>;

    // `guest` (may be null) is paused for switchover and throttled by
    // auto-converge; it outlives this object.
    OutgoingMigration(uv_loop_t *loop, LoopDispatcher &dispatcher, std::vector<RAMBlock> &blocks,
                      GuestControl *guest, OnStatus on_status, OnPass on_pass);
    ~OutgoingMigration();

    // Loop thread.
    Status start(const MigrationAddress &addr, const OutgoingParams &params);
    // Where fd:NAME URIs get their descriptors (the monitor's table).
    void set_fd_source(FdSource fds) { fd_source_ = std::move(fds); }
    void cancel();
    MigrationStatus status() const { return status_; }
    nlohmann::json query() const;
    // Live max-bandwidth changes apply at once, as in QEMU.
    void set_max_bandwidth(uint64_t bw) { max_bandwidth_ = bw; }
    // `stop`/`cont` during a migration: decides the run state sent at
    // switchover and whether a failed one resumes the guest.
    void set_vm_running(bool running) { vm_running_ = running; }

private:
    class Runner;
    friend class Runner;

    void on_connected(Result<std::vector<int>> fds);
    void set_status(MigrationStatus s);
    void set_status_from(MigrationStatus from, MigrationStatus to);
    // Any thread: un-pauses the guest unless the user paused the VM.
    void resume_guest_if_running();
    void finish(std::optional<Error> err);

    uv_loop_t *loop_;
    LoopDispatcher &dispatcher_;
    std::vector<RAMBlock> &blocks_;
    GuestControl *guest_;
    OnStatus on_status_;
    OnPass on_pass_;

    // Loop thread only.
    MigrationStatus status_ = MigrationStatus::None;
    OutgoingParams params_;
    std::string error_desc_;
    std::thread thread_;
    uint64_t generation_ = 0; // ignores connects of a cancelled attempt
    std::shared_ptr<SocketConnect> connect_; // while connecting
    FdSource fd_source_;
    std::shared_ptr<CommandChild> child_;     // exec: the command

    // Written by the migration thread, read by the loop (query).
    struct Stats {
        std::atomic<uint64_t> main_bytes{0};
        std::atomic<uint64_t> multifd_bytes{0};
        std::atomic<uint64_t> normal{0};
        std::atomic<uint64_t> zero{0};
        std::atomic<uint64_t> precopy_bytes{0};
        std::atomic<uint64_t> downtime_bytes{0};
        std::atomic<uint64_t> remaining_pages{0};
        std::atomic<uint64_t> dirty_sync_count{0};
        std::atomic<uint64_t> dirty_pages_rate{0};
        std::atomic<int64_t> setup_time_ms{0};
        std::atomic<int64_t> total_time_ms{0}; // set at the end
        std::atomic<int64_t> downtime_ms{0};
        std::atomic<int64_t> expected_downtime_ms{0};
        std::atomic<uint64_t> pages_per_second{0};
        std::atomic<double> mbps{0};
        std::atomic<unsigned> cpu_throttle_pct{0};
    };
    std::unique_ptr<Stats> stats_ = std::make_unique<Stats>(); // replaced at start()
    std::chrono::steady_clock::time_point start_time_;
    uint64_t total_bytes_ = 0;

    // Shared: set by the loop, read by the migration thread.
    std::atomic<bool> cancel_requested_{false};
    std::atomic<uint64_t> max_bandwidth_{0};
    std::atomic<bool> vm_running_{true}; // set by the loop, read at switchover
    std::mutex fds_mu_;
    std::vector<int> fds_; // protected by fds_mu_: shut down on cancel
};

} // namespace qmigd
