// IncomingAttempt: one migrate-incoming's channels, threads, parking and counters; IncomingOwner.
//
// IncomingMigration makes a new one at each migrate-incoming (nothing per
// run is reset by hand) and drops it once its threads are joined, keeping
// only what query-migrate reads (counts()).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/channel.h"
#include "daemon/dest/incoming_params.h"
#include "daemon/dest/mapped_ram_load.h"
#include "daemon/dest/multifd_recv.h"
#include "daemon/dest/return_path.h"
#include "daemon/io/command_channel.h"
#include "daemon/io/migration_socket.h"
#include "daemon/io/unique_fd.h"
#include "daemon/migration_status.h"
#include "daemon/park/parked_vm.h"
#include "daemon/ram_blocks.h"
#include "daemon/socket_io.h"
#include "daemon/thread_safety.h"
#include "protocol/error.h"
#include "protocol/loadvm.h"
#include "ramstate/received_bitmap.h"

namespace qmigd {

class ImageLoadHandler;
class PendingConnection;
struct IncomingAttempt;

// What an attempt received: pages (normal, zero) and bytes.
struct IncomingCounts {
    uint64_t normal = 0;
    uint64_t zero = 0;
    uint64_t bytes = 0;
};

// What an attempt's threads ask of the loop (IncomingMigration), as the
// source's MigrationThread asks MigrationOwner. Called from the attempt's
// threads; each posts to the loop, where it applies only while `run` is
// still the current attempt (and the owner still exists).
class IncomingOwner {
public:
    // Load thread, last: the attempt ended (its other threads joined).
    virtual void post_end(std::weak_ptr<IncomingAttempt> run, std::optional<Error> err,
                          std::string runstate, std::optional<ParkedVm> parked) = 0;
    // A status change, applied if the status is still `from` then.
    virtual void post_status(std::weak_ptr<IncomingAttempt> run, MigrationStatus from,
                             MigrationStatus to) = 0;
    // Park mode: the blocks made go to the daemon's list; the owner then
    // calls run->blocks_arrived() on the loop.
    virtual void post_blocks(std::shared_ptr<IncomingAttempt> run,
                             std::vector<RAMBlock> made) = 0;
    // The preempt channel broke in postcopy: the whole load pauses, as
    // for migrate-pause.
    virtual void post_pause(std::weak_ptr<IncomingAttempt> run) = 0;

protected:
    ~IncomingOwner() = default;
};

struct IncomingAttempt : std::enable_shared_from_this<IncomingAttempt> {
public:
    // Loop thread: `params` are copied (the threads read them); `blocks`
    // is the daemon's list (see IncomingMigration::blocks_).
    IncomingAttempt(IncomingOwner &owner, const IncomingParams &params,
                    std::vector<RAMBlock> &blocks)
        : owner_(owner), params_(params), blocks_(blocks)
    {
    }
    IncomingAttempt(const IncomingAttempt &) = delete;
    IncomingAttempt &operator=(const IncomingAttempt &) = delete;
    // A classified channel: the bytes read to tell what it is (the main
    // channel's stream starts with them) and the channel itself.
    struct Accepted {
        std::unique_ptr<Channel> ch;
        std::vector<uint8_t> prefix;
    };

    // Loop thread, before start_load(): the channels as they come.
    // `slots`: how many multifd channels to wait for (0: none).
    void expect_multifd(size_t slots) { multifd_.resize(slots); }
    // Loop thread, before the attempt starts: the park directory's lock
    // (park_dir_lock()), held until the attempt is destroyed.
    void claim_park_dir(UniqueFd lock) { park_lock_ = std::move(lock); }
    size_t multifd_expected() const { return multifd_.size(); }
    size_t multifd_arrived() const;
    // Refused when channel `id` is there already (`ch` stays the caller's).
    Status add_multifd(size_t id, std::unique_ptr<Channel> &ch);
    void set_main(Accepted main) { main_ = std::move(main); }
    void set_child(std::shared_ptr<CommandChild> child) { child_ = std::move(child); }
    void set_file_in(MappedRamFileIn in) { file_in_ = std::move(in); }
    // Loop thread, any time: the main channel came (it stays until the
    // attempt goes); its descriptor (the loop only asks what is queued).
    bool has_main() const { return main_.has_value(); }
    int main_fd() const { return main_->ch->fd(); }
    // Loop thread: the main channel and every multifd channel came.
    bool channels_complete() const;
    // Loop thread, once: the load's configuration from the blocks and
    // params, then the load thread, which starts the receive threads.
    void start_load();
    // Loop thread: joins the load thread (its post_end() came), or ends it
    // first (the daemon quits: an exec: command is killed at once).
    void join_load();
    void quit();
    // Loop thread: migrate_cancel came (the caller aborts the threads);
    // false, and nothing done, once a park is committing its VM (writing
    // its record): too late to cancel, the park completes.
    bool request_cancel();
    bool cancel_requested() const { return cancel_requested_; }
    // Any thread: the park's record is written (the VM is parked whole).
    bool park_committed()
    {
        MutexLock lk(park_mu_);
        return park_committed_;
    }
    // Once its threads are joined: the images the park created.
    std::vector<std::string> park_created()
    {
        MutexLock lk(park_mu_);
        return park_created_;
    }
    // Loop thread, at accept while loading with postcopy-preempt: the
    // first connection after the main channel is the preempt channel, and
    // gets its reader thread (false: not taken, a stranger).
    bool take_preempt(PendingConnection *c);
    // Loop thread: migrate-recover's first connection, the paused load's
    // new main channel (postcopy_pause_incoming() takes it).
    void take_recovered(UniqueFd fd);
    // Loop thread: migrate-pause (the main channel is shut down; a load
    // thread waiting for the preempt channel's end marker stops waiting).
    void pause();
    // Loop thread: the owner appended the blocks post_blocks() gave it.
    void blocks_arrived();
    // Any thread: record the first error and wake every thread.
    void abort_with(const Error &err);
    // Loop thread: yank in precopy: every channel shut down, no error of
    // its own (the load fails on its reads, as QEMU's does).
    void yank();
    // After the main stream (load thread, `drain`: the reader reads to the
    // source's end marker first) or at the attempt's end (loop): wakes and
    // joins the preempt reader; no preempt channel is taken after it.
    // Returns true when a migrate-pause ended the drain before the end
    // marker came.
    bool end_preempt(bool drain = false);
    // Any thread: what the threads received so far (query-migrate's
    // "incoming"; the loop keeps the last values once they are joined).
    IncomingCounts counts() const
    {
        return {normal_pages_.load(), zero_pages_.load(), bytes_.load()};
    }

private:
    // Load thread: load_thread_main() and its steps.
    void load_thread_main();
    Status open_return_path();
    void watch_postcopy(ImageLoadHandler &handler);
    Result<LoadvmResult> load_postcopy(LoadvmSession &session, ImageLoadHandler &handler,
                                       Result<LoadvmResult> result);
    std::optional<ParkedVm> end_stream(Result<LoadvmResult> &result, ImageLoadHandler &handler);
    void end_channels(const Result<LoadvmResult> &result, ImageLoadHandler &handler);
    void recv_thread_main(size_t id);
    // The preempt channel's reader (taken by take_preempt()).
    void preempt_thread_main(Channel *ch);
    Status preempt_load(Channel *ch);
    void preempt_failed(const Error &err);
    // Postcopy recovery (QEMU's postcopy_pause_incoming()): the load thread
    // waits for the new main channel (migrate-recover's first connection,
    // taken by take_recovered() on the loop), or for the migration's end.
    Result<Channel *> postcopy_pause_incoming(const Error &why);
    // The main channel the load thread reads now (main_'s, or the last
    // recovery's).
    Channel *current_main() REQUIRES(recover_mu_);
    // Park mode. Load thread: creates the announced blocks' images.
    Status park_announce(const std::vector<RamBlockDesc> &descs);
    // Load thread: the blocks park_announce() made go to the daemon's list
    // on the loop; returns once they are there (or the migration aborted).
    Status hand_over_blocks(std::vector<RAMBlock> made);
    // Receive threads: the block list to decode packets with (null once
    // the migration is aborted).
    const std::vector<RamBlockDesc> *packet_blocks();
    // Load thread, after the stream: writes device state and record;
    // returns the parked VM for the loop thread's query.
    Result<ParkedVm> park_finish(LoadvmResult &result);
    // Any thread: the preempt and multifd channels shut down (their
    // readers' calls fail); the main channel is the caller's to end.
    void shutdown_side_channels();

    IncomingOwner &owner_;
    const IncomingParams params_; // set at construction, read-only
    UniqueFd park_lock_;          // claim_park_dir(); not touched after
    std::vector<RAMBlock> &blocks_;

    // Loop thread only: migrate_cancel came (finish() reports `cancelled`).
    bool cancel_requested_ = false;
    // Started by the loop (start_load()), joined by it (join_load() or quit()).
    std::thread load_thread_;

    // Written by the loop before the load thread starts (the setters,
    // start_load()), read-only while the migration threads run
    // (abort_with() reads them from any thread), closed with the attempt
    // once they are joined.

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
    // A cancel (park_cancelled_) and the commit of a parked VM
    // (park_committing_: its device state and record are being written)
    // exclude each other: whichever comes first decides the park.
    bool park_cancelled_ GUARDED_BY(park_mu_) = false;
    bool park_committing_ GUARDED_BY(park_mu_) = false;
    bool park_committed_ GUARDED_BY(park_mu_) = false; // its record is written
    // The images park_announce() created, as it created them: a daemon that
    // quits before the loop took them into its list removes them too.
    std::vector<std::string> park_created_ GUARDED_BY(park_mu_);
    // Written once by the load thread before park_ready_; its readers take
    // it under park_mu_ (packet_blocks() hands the receive threads a
    // pointer once park_ready_ is seen; it changes no more).
    std::vector<RamBlockDesc> park_descs_ GUARDED_BY(park_mu_);

    // The preempt channel: taken on the loop, read by its thread, ended by
    // the load thread (or the loop at the attempt's end); all three under
    // preempt_mu_.
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
    // open until the attempt goes); `recover_new_`: the load thread has not taken it.
    std::unique_ptr<Channel> recovered_ GUARDED_BY(recover_mu_);
    bool recover_new_ GUARDED_BY(recover_mu_) = false;
    bool recover_abort_ GUARDED_BY(recover_mu_) = false;
    // With postcopy-ram, one per block, made once the blocks are known and
    // before pages come (start_load() on the loop, or park_announce() on
    // the load thread before park_ready_), then read by the load and
    // preempt threads: what a recovery tells the source we have.
    std::vector<std::unique_ptr<ReceivedBitmap>> received_;

    // Receive threads: how many multifd packets came, and the highest
    // packet_num. A source numbers every packet of all its channels in one
    // sequence (QEMU's multifd_send_fill_packet()), so once the last flush
    // has passed, packets_ == top_packet_ + 1 unless some went on a channel
    // this destination closed (check_packets(), load thread).
    std::atomic<uint64_t> packets_{0};
    std::atomic<uint64_t> top_packet_{0};
    void count_packet(uint64_t packet_num);
    Status check_packets() const;

    // Added to by the load, receive and preempt threads; counts() reads
    // them from any thread.
    std::atomic<uint64_t> normal_pages_{0};
    std::atomic<uint64_t> zero_pages_{0};
    std::atomic<uint64_t> bytes_{0};
};

} // namespace qmigd
