// The source side of a migration: the main migration thread (QEMU's
// migration_thread + ram_save_setup/iterate/complete) driving multifd
// sender threads.
//
// Threads:
//  - loop thread: migrate / migrate_cancel / query-migrate, connects the
//    channels (libuv), receives status changes through the dispatcher.
//  - migration thread (migration_thread.h): owns the main channel, the
//    dirty bitmaps' migration copies and the multifd hand-off; publishes
//    counters as atomics (migration_state.h).
//  - multifd sender threads (multifd_send.h).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <uv.h>

#include "daemon/loop_dispatcher.h"
#include "daemon/source/migration_state.h"
#include "daemon/source/migration_thread.h"
#include "daemon/migration_status.h"
#include "daemon/ram_blocks.h"
#include "daemon/thread_safety.h"
#include "daemon/io/command_channel.h"
#include "daemon/io/migration_address.h"
#include "daemon/io/socket_channels.h"
#include "ramstate/guest_control.h"

namespace qmigd {

class OutgoingMigration final : private MigrationOwner {
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
    // `migrate resume=true` (QEMU's migrate_prepare() with resume): a
    // paused postcopy goes on over a new connection to addr.
    Status resume(const MigrationAddress &addr);
    // migrate-pause in postcopy: the channels are shut down, and the
    // migration thread pauses as for a broken link.
    void pause();
    // yank of the migration instance: every channel shut down, nothing
    // else; the migration thread fails (or, in postcopy, pauses) on its
    // broken channels as on a dead peer's.
    void yank()
    {
        shared_->yanked = true;
        shutdown_channels();
    }
    MigrationStatus status() const { return status_; }
    nlohmann::json query() const;
    // Live max-bandwidth changes apply at once, as in QEMU.
    void set_max_bandwidth(uint64_t bw) { shared_->max_bandwidth = bw; }
    // `stop`/`cont` during a migration: decides the run state sent at
    // switchover and whether a failed one resumes the guest.
    void set_vm_running(bool running) { shared_->vm_running = running; }
    // migrate-start-postcopy: the migration thread switches at its next
    // iteration (a migration that ends first ignores it, as in QEMU).
    void start_postcopy() { shared_->start_postcopy = true; }
    // migrate-continue: a migration paused before switchover goes on.
    void continue_switchover();
    void set_max_postcopy_bandwidth(uint64_t bw) { shared_->max_postcopy_bandwidth = bw; }
    // The postcopy package went: the VM may run at the destination.
    bool vm_handed_over() const { return shared_->vm_handed_over; }

private:
    void on_connected(Result<std::vector<UniqueFd>> fds);
    void set_status(MigrationStatus s);
    void set_status_from(MigrationStatus from, MigrationStatus to);
    // MigrationOwner, called from the migration thread.
    void post_status(MigrationStatus from, MigrationStatus to) override;
    void post_pass(uint64_t n) override;
    // Any thread: un-pauses the guest unless the user paused the VM.
    void resume_guest_if_running() override;
    void add_channel(Channel &ch) override EXCLUDES(channels_mu_);
    void remove_channel(Channel &ch) override EXCLUDES(channels_mu_);
    // Loop thread: cancel, migrate-pause and quit wake the thread this way.
    void shutdown_channels() EXCLUDES(channels_mu_);
    void finish(std::optional<Error> err);

    // Set at construction, read-only after. The blocks are the migration
    // thread's while it runs; the guest is called from both threads (its
    // record's fields are atomics, ramstate/guest_control.h); the
    // callbacks run on the loop (posted through the dispatcher).
    uv_loop_t *loop_;
    LoopDispatcher &dispatcher_;
    std::vector<RAMBlock> &blocks_;
    GuestControl *guest_;
    OnStatus on_status_;
    OnPass on_pass_;

    // Written at start() by the loop, before the migration thread starts,
    // which copies it as it starts (MigrationThread::p_); read by the loop.
    OutgoingParams params_;

    // Loop thread only.
    MigrationStatus status_ = MigrationStatus::None;
    std::string error_desc_;
    std::thread thread_;
    uint64_t generation_ = 0; // ignores connects of a cancelled attempt
    std::shared_ptr<SocketConnect> connect_; // while connecting
    FdSource fd_source_;
    std::shared_ptr<CommandChild> child_;     // exec: the command

    // With the migration thread (migration_state.h); replaced at start(),
    // by the loop, once the previous migration thread was joined.
    std::unique_ptr<MigrationShared> shared_ = std::make_unique<MigrationShared>();
    uint64_t total_bytes_ = 0; // set at construction, read-only after

    // The migration thread's channels, borrowed: it adds each once it
    // exists and removes it before destroying it (MigrationOwner).
    Mutex channels_mu_;
    std::vector<Channel *> channels_ GUARDED_BY(channels_mu_);
};

} // namespace qmigd
