// One incoming migration attempt's per-run state: its channels, threads, parking and counters.
//
// IncomingMigration makes a new one at each migrate-incoming, once the
// previous attempt's threads are joined: nothing per run is reset by hand.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/channel.h"
#include "daemon/dest/mapped_ram_load.h"
#include "daemon/dest/multifd_recv.h"
#include "daemon/dest/return_path.h"
#include "daemon/io/command_channel.h"
#include "daemon/park/parked_vm.h"
#include "daemon/io/migration_socket.h"
#include "daemon/socket_io.h"
#include "daemon/thread_safety.h"
#include "protocol/loadvm.h"
#include "ramstate/received_bitmap.h"

namespace qmigd {

struct IncomingAttempt {
    // A classified channel: the bytes read to tell what it is (the main
    // channel's stream starts with them) and the channel itself.
    struct Accepted {
        std::unique_ptr<Channel> ch;
        std::vector<uint8_t> prefix;
    };

    // Loop thread only: the attempt's outcome, for query-migrate.
    std::string runstate_ = "inmigrate"; // the source's globalstate, once complete
    std::string error_desc_;
    bool cancel_requested_ = false;
    // The parked VM once complete (query): the load thread hands it over
    // with finish().
    std::optional<ParkedVm> parked_;
    // Started by the loop (maybe_start()), joined by it (finish(), or the
    // next start() / the destructor).
    std::thread load_thread_;

    // Written by the loop before the load thread starts (start(), setup's
    // channels, maybe_start()), read-only while the migration threads run
    // (abort_with() reads them from any thread), reset by the loop once
    // they are joined (cleanup_channels()).

    std::shared_ptr<CommandChild> child_; // exec: the command
    std::optional<Accepted> main_;
    MappedRamFileIn file_in_; // mapped-ram: main_'s file, and O_DIRECT fds
    std::vector<std::optional<Accepted>> multifd_;
    LoadvmConfig load_cfg_;
    std::unique_ptr<MultifdRecvSync> sync_;

    // Load thread only (started and joined by it).
    std::vector<std::thread> recv_threads_;
    // The return path, once the stream opened it: the load thread's only
    // (pongs, then the SHUT); rp_open_ tells abort_with() from any thread.
    std::unique_ptr<ReturnPathOut> rp_;

    // Shared with the migration threads.
    Mutex err_mu_;
    std::optional<Error> thread_error_ GUARDED_BY(err_mu_);
    std::atomic<bool> loading_done_{false};
    std::atomic<bool> rp_open_{false};
    // Every write rp_ makes; abort_with() ends one a source never reads.
    PeerWriteGuard rp_writes_;
    // The package's LISTEN came: from now on a broken channel, the preempt
    // channel's included, pauses instead of failing.
    std::atomic<bool> postcopy_listening_{false};
    // Park mode: the load thread makes the blocks, hands them to the loop
    // (blocks_handed_), fills park_descs_ once, then sets park_ready_;
    // receive threads wait for it before their first packet (a multifd
    // packet can overtake the ram START section).
    Mutex park_mu_;
    std::condition_variable park_cv_;
    bool park_ready_ GUARDED_BY(park_mu_) = false;
    bool park_abort_ GUARDED_BY(park_mu_) = false;
    bool blocks_handed_ GUARDED_BY(park_mu_) = false;
    // Written under park_mu_ by the load thread before park_ready_, read
    // without it after (packet_blocks() returns it once park_ready_ is seen).
    std::vector<RamBlockDesc> park_descs_;

    // The preempt channel: taken on the loop, read by its thread, ended by
    // the load thread (or cleanup); all three under preempt_mu_.
    Mutex preempt_mu_;
    std::condition_variable preempt_cv_; // preempt_done_ set
    std::unique_ptr<Channel> preempt_ GUARDED_BY(preempt_mu_);
    bool preempt_ended_ GUARDED_BY(preempt_mu_) = false;    // shut down here
    bool preempt_draining_ GUARDED_BY(preempt_mu_) = false; // the main stream ended
    bool preempt_done_ GUARDED_BY(preempt_mu_) = false;     // the reader returned
    bool preempt_used_ GUARDED_BY(preempt_mu_) = false;     // a byte came on it
    bool pause_requested_ GUARDED_BY(preempt_mu_) = false;  // migrate-pause not yet acted on
    std::thread preempt_thread_ GUARDED_BY(preempt_mu_);

    // Postcopy recovery's hand-over, loop thread to load thread.
    Mutex recover_mu_;
    std::condition_variable recover_cv_;
    // The main channel since the last recovery (main_'s, shut down, stays
    // open until cleanup); `recover_new_`: the load thread has not taken it.
    std::unique_ptr<Channel> recovered_ GUARDED_BY(recover_mu_);
    bool recover_new_ GUARDED_BY(recover_mu_) = false;
    bool recover_abort_ GUARDED_BY(recover_mu_) = false;
    // With postcopy-ram, one per block, made once the blocks are known and
    // before pages come (maybe_start() on the loop, or park_announce() on
    // the load thread before park_ready_), then read by the load and
    // preempt threads: what a recovery tells the source we have.
    std::vector<std::unique_ptr<ReceivedBitmap>> received_;

    std::atomic<uint64_t> normal_pages_{0};
    std::atomic<uint64_t> zero_pages_{0};
    std::atomic<uint64_t> bytes_{0};
};

} // namespace qmigd
