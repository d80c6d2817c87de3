// The destination side of a migration (QEMU's migration/migration.c
// incoming path + savevm load + multifd receive threads).
//
// Threads:
//  - loop thread: listen, accept, classify channels, status, query.
//  - load thread: reads the main channel (qemu_loadvm_state); it is the
//    coordinator that joins the receive threads and reports the end.
//  - one receive thread per multifd channel.
//  - with postcopy-preempt, the preempt thread (postcopy.cpp).
//  - TLS handshake threads (TlsHandshakes), which read params_ only.
// Any thread may call abort_with().
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <uv.h>

#include "daemon/channel.h"
#include "daemon/loop_dispatcher.h"
#include "daemon/migration_status.h"
#include "daemon/dest/incoming_attempt.h"
#include "daemon/dest/incoming_params.h"
#include "daemon/dest/mapped_ram_load.h"
#include "daemon/dest/multifd_recv.h"
#include "daemon/park/parked_vm.h"
#include "daemon/ram_blocks.h"
#include "daemon/thread_safety.h"
#include "daemon/dest/return_path.h"
#include "daemon/socket_io.h"
#include "daemon/io/command_channel.h"
#include "daemon/io/migration_address.h"
#include "daemon/io/socket_channels.h"
#include "protocol/loadvm.h"
#include "daemon/tls/tls_handshakes.h"
#include "daemon/tls/tls_session.h"
#include "protocol/multifd_compress.h"
#include "ramstate/received_bitmap.h"

namespace qmigd {

class ImageLoadHandler;

class IncomingMigration {
public:
    using OnStatus = std::function<void(MigrationStatus)>;

    IncomingMigration(uv_loop_t *loop, LoopDispatcher &dispatcher,
                      std::vector<RAMBlock> &blocks, OnStatus on_status);
    ~IncomingMigration();

    // Loop thread. Starts listening (migrate-incoming).
    Status start(const MigrationAddress &addr, const IncomingParams &params);
    // Where fd:NAME URIs get their descriptors (the monitor's table).
    void set_fd_source(FdSource fds) { fd_source_ = std::move(fds); }
    // Loop thread. migrate_cancel on the destination (QEMU ignores it): ends
    // the incoming migration, listening or loading, as `cancelled`; a new
    // migrate-incoming may follow.
    void cancel();
    MigrationStatus status() const { return status_; }
    // query-migrate body.
    nlohmann::json query() const;
    // The run state the source sent in globalstate (after completion).
    const std::string &runstate() const { return run_->runstate_; }
    // migrate-pause in postcopy: the main channel is shut down and the
    // load pauses as for a broken link.
    void pause();
    // migrate-recover: listens on addr; the first connection is the new
    // main channel of the paused load (QEMU takes it by its order).
    Status recover(const MigrationAddress &addr);

private:
    // The channels are the load threads' (active, or in postcopy).
    bool loading() const
    {
        return status_ == MigrationStatus::Active || migration_in_postcopy(status_);
    }

    void on_prefix(PendingConnection *c, const Error *err);
    // Takes a classified connection: the main channel or a multifd one
    // (its init message in `prefix`). Drops (closes) it on failure.
    void adopt(std::vector<uint8_t> prefix, std::unique_ptr<Channel> ch);
    Status accept_multifd(const std::vector<uint8_t> &prefix, std::unique_ptr<Channel> &ch);
    // TLS: the handshake and the first decrypted bytes, on a thread of
    // handshakes_; the result comes back to the loop (tls_ready).
    void start_tls(PendingConnection *c);
    static size_t tls_record_wanted(const std::vector<uint8_t> &prefix);
    void handshake_on_thread(UniqueFd fd, std::vector<uint8_t> raw);
    Result<std::vector<uint8_t>> tls_identify(int fd, std::vector<uint8_t> raw,
                                              TlsHandshakes::Progress &progress,
                                              std::unique_ptr<TlsSession> *tls);
    // `ended`: handshakes_ ended it (a stranger past its deadline). `ch`
    // carries its TLS session when the handshake went through.
    void tls_ready(uint64_t generation, std::unique_ptr<Channel> ch,
                   Result<std::vector<uint8_t>> prefix, bool ended);
    // Active: a connection that identified itself as one more migration
    // channel ends the migration; anything else is a stranger's. The
    // caller drops (closes) the connection.
    void extra_connection(const std::vector<uint8_t> &prefix);
    Status open_mapped_ram(const MigrationAddress &addr, int fd);
    // The listener's end of setting up (SocketListener::OnListening).
    void listening(const Status &st);
    void maybe_start();
    void set_status(MigrationStatus s);
    void fail_setup(const Error &err);
    void cleanup_channels();
    void finish(std::optional<Error> err, std::string runstate);

    // Load thread: load_thread_main() and its steps.
    void load_thread_main();
    Status open_return_path();
    void watch_postcopy(ImageLoadHandler &handler);
    Result<LoadvmResult> load_postcopy(LoadvmSession &session, ImageLoadHandler &handler,
                                       Result<LoadvmResult> result);
    std::optional<ParkedVm> end_stream(Result<LoadvmResult> &result, ImageLoadHandler &handler);
    void end_channels(const Result<LoadvmResult> &result, ImageLoadHandler &handler);
    void recv_thread_main(size_t id);
    // Postcopy preempt (QEMU's postcopy_preempt_new_channel()): with
    // postcopy-preempt, the first connection after the main channel is
    // taken at accept, by its order as QEMU does (it sends nothing until a
    // page goes on it), and read by a thread of its own.
    bool take_preempt(PendingConnection *c);
    // `generation`: the migration's when the channel was taken.
    void preempt_thread_main(Channel *ch, uint64_t generation);
    Status preempt_load(Channel *ch);
    void preempt_failed(const Error &err, uint64_t generation);
    // After the main stream (load thread, `drain`: the reader reads to the
    // source's end marker first) or at cleanup (loop): wakes and joins the
    // preempt reader; no preempt channel is taken after it. Returns true
    // when a migrate-pause ended the drain before the end marker came.
    bool end_preempt(bool drain = false);
    // Postcopy recovery (QEMU's postcopy_pause_incoming()): the load thread
    // waits for the new main channel (migrate-recover's first connection,
    // taken by take_recovered() on the loop), or for the migration's end.
    Result<Channel *> postcopy_pause_incoming(const Error &why);
    bool take_recovered(PendingConnection *c);
    // The main channel the load thread reads now (main_'s, or the last
    // recovery's).
    Channel *current_main() REQUIRES(run_->recover_mu_);
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
    // Loop thread, after a failed or cancelled park: its images go.
    void park_discard();
    // Any thread: record the first error and wake every thread.
    void abort_with(const Error &err);
    // Any thread: runs fn on the loop unless this object is gone by then
    // (the daemon quits: the dispatcher may still run what the threads
    // posted before the destructor joined them).
    void post_to_loop(std::function<void()> fn);

    uv_loop_t *loop_;
    LoopDispatcher &dispatcher_;
    // The daemon's blocks. The loop writes the list (a park's blocks are
    // appended by hand_over_blocks()'s post, dropped by park_discard());
    // the migration threads read it while they run, once it holds the
    // blocks they use (load_cfg_'s, or park_ready_'s).
    std::vector<RAMBlock> &blocks_;
    OnStatus on_status_;

    // Loop thread only.
    MigrationStatus status_ = MigrationStatus::None;
    std::unique_ptr<SocketListener> listener_;
    FdSource fd_source_;
    // Multifd on here, the main channel in, multifd channels missing: a
    // source with multifd off sends RAM pages on the main channel and
    // never opens one (QEMU 10 waits in `setup` for ever). Polls the main
    // channel's queued bytes until the channels come or kMultifdWaitMs
    // (or the link timeout, if shorter).
    static constexpr uint64_t kMultifdWaitMs = 10000;
    static constexpr int kMainPagesQueued = 32 * 1024; // more than any setup part
    uv_timer_t *multifd_wait_ = nullptr;
    uint64_t main_since_ms_ = 0;
    void watch_multifd();
    void check_multifd_missing();
    void stop_multifd_watch();
    // What strangers on the migration port may hold (connections that have
    // not identified themselves, TLS handshakes): bounded, with a deadline.
    ListenerLimits stranger_limits() const;
    // TLS handshakes in progress.
    static constexpr size_t kMaxTlsHandshakes = 32;
    std::unique_ptr<TlsHandshakes> handshakes_;
    uint64_t tls_failed_logged_ms_ = 0; // uv_now() of the last failed-handshake line
    uint64_t tls_failed_quiet_ = 0;     // failures not logged since
    uint64_t generation_ = 0; // a new migrate-incoming or cleanup: late results are dropped
    // Written by the loop at start() only; read by the migration threads
    // while they run and by the handshake threads (tls_identify()).
    IncomingParams params_;
    // The current (or last) attempt: a new migrate-incoming makes a new
    // one once the previous one's threads are joined, so nothing per run
    // is reset by hand. Loop thread writes the pointer; the migration
    // threads use the object it points to while they run.
    std::shared_ptr<IncomingAttempt> run_ = std::make_shared<IncomingAttempt>();
    // Expires with this object: what post_to_loop() checks on the loop.
    std::shared_ptr<const bool> alive_ = std::make_shared<const bool>(true);
};

} // namespace qmigd
