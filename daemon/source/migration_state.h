// What the source's loop thread and its migration thread share (QEMU
// keeps these in MigrationState): the parameters a migration started with,
// its counters, and the few flags the loop changes while it runs.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <vector>
#include <cstdint>
#include <optional>
#include <string>

#include "daemon/channel.h"
#include "daemon/park/parked_vm.h"
#include "daemon/park/working_set.h"
#include "daemon/thread_safety.h"
#include "daemon/tls/tls_creds.h"
#include "protocol/error.h"
#include "protocol/multifd_compress.h"
#include "protocol/qemu_format.h"
#include "ramstate/zero_page.h"

namespace qmigd {

// Copied at `migrate`: a running migration never reads live parameters.
struct OutgoingParams {
    bool multifd = false;
    unsigned channels = 2;
    ZeroPageDetection zpd = ZeroPageDetection::Multifd;
    uint64_t max_bandwidth = 0; // bytes/s, 0 = unlimited
    uint64_t downtime_limit_ms = 300;
    std::string machine_type = "none";
    Uuid uuid{};
    // A parked VM (source --ram-dir): its configuration, ram section id and
    // device state go out as they were received; no timer or globalstate
    // of our own.
    std::shared_ptr<const ParkedVm> parked;
    // A parked VM's postcopy resume: its working set first, this resume's
    // requests recorded (daemon/source/postcopy_working_set.h).
    WorkingSetOptions working_set;
    std::string runstate = "running"; // of the VM when the migration starts
    // auto-converge (QEMU's cpu throttling, applied through GuestControl).
    bool auto_converge = false;
    unsigned throttle_initial = 20;
    unsigned throttle_increment = 10;
    unsigned max_throttle = 99;
    unsigned throttle_trigger_threshold = 50;
    unsigned link_timeout_ms = 30000; // dead-link detection, 0 = never
    // SO_SNDBUF of every channel when the destination is on this host
    // (set_send_buffer() says why); 0 keeps the kernel's autotuning.
    unsigned local_send_buffer = 128 << 10;
    // mapped-ram (file: only): pages at fixed offsets; with multifd each
    // channel is a descriptor of the same file, O_DIRECT with direct_io.
    bool mapped_ram = false;
    bool direct_io = false;
    // return-path: OPEN_RETURN_PATH after the header, and the migration
    // completes only once the destination says SHUT(0) (source/return_path.h).
    bool return_path = false;
    // postcopy-ram: POSTCOPY_ADVISE at setup (with a return path whatever
    // return-path says), and migrate-start-postcopy switches over to
    // postcopy (daemon/source/postcopy.cpp).
    bool postcopy_ram = false;
    // postcopy-preempt: at the switch a second connection to the
    // destination carries the pages it asks for, ahead of the main channel.
    bool postcopy_preempt = false;
    uint64_t max_postcopy_bandwidth = 0; // bytes/s once in postcopy, 0 = unlimited
    // pause-before-switchover: with the VM stopped, the status goes
    // pre-switchover until migrate-continue (libvirt ends its block jobs).
    bool pause_before_switchover = false;
    // switchover-ack (with the return path): no switchover before the
    // destination's SWITCHOVER_ACK while the VM runs.
    bool switchover_ack = false;
    // validate-uuid: the configuration section carries the VM's UUID (the
    // parked VM's, else --uuid) for the destination to check.
    bool validate_uuid = false;
    // x-ignore-shared: blocks in a shared memory file are listed but no
    // page of theirs is sent: the destination maps the same file.
    bool ignore_shared = false;
    // xbzrle: deltas against a page cache of xbzrle_cache_size bytes.
    bool xbzrle = false;
    // zero-copy-send: multifd pages go with MSG_ZEROCOPY (sockets only).
    bool zero_copy = false;
    // mode cpr-reboot: the guest stops before the first page goes and the
    // whole state is sent stopped (QEMU stops the VM as the migration
    // connects): no live iteration, downtime is the whole transfer.
    bool stop_first = false;
    uint64_t xbzrle_cache_size = 64 << 20;
    // multifd-compression (multifd channels only).
    MultiFDCompressionParams compression;
    // tls-creds (client endpoint), tls-hostname: every channel. Not on
    // file: (a file cannot answer a handshake): the daemon refuses it.
    TlsParams tls;
    // Why tls-creds cannot be used: QEMU looks the object up once the
    // migration runs, so the migration fails with this, not the command.
    std::optional<Error> tls_error;
};

// Counters: written by the migration thread, read by the loop (query).
struct MigrationStats {
    std::atomic<uint64_t> main_bytes{0};
    std::atomic<uint64_t> multifd_bytes{0};
    std::atomic<uint64_t> normal{0};
    std::atomic<uint64_t> zero{0};
    std::atomic<uint64_t> precopy_bytes{0};
    std::atomic<uint64_t> downtime_bytes{0};
    std::atomic<uint64_t> postcopy_bytes{0};
    std::atomic<uint64_t> postcopy_requests{0};
    // A parked VM's postcopy resume with its working set on: pages sent as
    // the working set, and how many of them the destination asked for.
    std::atomic<bool> working_set{false};
    std::atomic<uint64_t> working_set_pages{0};
    std::atomic<uint64_t> working_set_requested{0};
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
    std::atomic<uint64_t> zero_copy_missed{0}; // dirty-sync-missed-zero-copy
    // xbzrle-cache (daemon/source/xbzrle_save.h); the rates per dirty-rate period.
    std::atomic<uint64_t> xbzrle_bytes{0};
    std::atomic<uint64_t> xbzrle_pages{0};
    std::atomic<uint64_t> xbzrle_cache_miss{0};
    std::atomic<uint64_t> xbzrle_overflow{0};
    std::atomic<double> xbzrle_cache_miss_rate{0};
    std::atomic<double> xbzrle_encoding_rate{0};
};

// One migration's shared state; the loop makes a new one at each start,
// after the previous migration thread was joined.
struct MigrationShared {
    MigrationStats stats;
    std::chrono::steady_clock::time_point start_time; // set before the thread starts, read-only after
    // Set by the loop, read by the migration thread.
    std::atomic<bool> cancel_requested{false};
    // yank: the channels' errors are ours, not a hint about the peer.
    std::atomic<bool> yanked{false};
    std::atomic<uint64_t> max_bandwidth{0}; // migrate-set-parameters applies at once
    std::atomic<bool> vm_running{true};     // stop/cont: the run state sent at switchover
    std::atomic<bool> start_postcopy{false}; // migrate-start-postcopy
    std::atomic<uint64_t> max_postcopy_bandwidth{0};
    // Set by the migration thread as the postcopy package goes: from then
    // on the destination may run the VM, so a failure never resumes it here.
    std::atomic<bool> vm_handed_over{false};
    // Postcopy recovery: a paused migration thread waits for the main
    // channel of `migrate resume=true`, which the loop makes, adds to its
    // channels to shut down (MigrationOwner) and hands over here, or for
    // `abandon` (cancel, quit). pause_error is error-desc meanwhile.
    Mutex resume_mu;
    std::condition_variable resume_cv;
    std::unique_ptr<Channel> resume_channel GUARDED_BY(resume_mu);
    bool abandon GUARDED_BY(resume_mu) = false;
    // pause-before-switchover: migrate-continue's posts (QEMU's pause_sem).
    unsigned continue_posts GUARDED_BY(resume_mu) = 0;
    std::string pause_error GUARDED_BY(resume_mu);
};

inline int64_t ms_since(std::chrono::steady_clock::time_point t)
{
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now() - t)
        .count();
}

} // namespace qmigd
