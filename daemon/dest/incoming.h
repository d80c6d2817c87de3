// The destination side of a migration, the loop's part (QEMU's
// migration/migration.c incoming path): listen, classify channels, status,
// query. Each migrate-incoming's channels and threads are an
// IncomingAttempt (incoming_attempt.h), which reaches this object only
// through IncomingOwner.
//
// Threads:
//  - loop thread: everything here.
//  - the attempt's load, receive and preempt threads (incoming_attempt.h).
//  - TLS handshake threads (TlsHandshakes), which read params_ only.
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

class IncomingMigration final : private IncomingOwner {
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
    const std::string &runstate() const { return outcome_.runstate; }
    // migrate-pause in postcopy: the main channel is shut down and the
    // load pauses as for a broken link.
    void pause();
    // yank of the migration instance (incoming_yank.cpp): every channel
    // shut down; the load fails, or in postcopy pauses, as on a dead peer.
    void yank();
    // migrate-recover: listens on addr; the first connection is the new
    // main channel of the paused load (QEMU takes it by its order).
    Status recover(const MigrationAddress &addr);

private:
    // The channels are the load threads' (active, or in postcopy).
    bool loading() const
    {
        return status_ == MigrationStatus::Active || migration_in_postcopy(status_);
    }

    void on_prefix(PendingConnection *c);
    // Takes a classified connection: the main channel or a multifd one
    // (its init message in `prefix`). Drops (closes) it on failure.
    void adopt(std::vector<uint8_t> prefix, std::unique_ptr<Channel> ch);
    Status accept_multifd(const std::vector<uint8_t> &prefix, std::unique_ptr<Channel> &ch);
    // TLS: the handshake and the first decrypted bytes, on a thread of
    // handshakes_; the result comes back to the loop (tls_ready).
    void start_tls(PendingConnection *c);
    static size_t tls_record_wanted(const std::vector<uint8_t> &prefix);
    void handshake_on_thread(UniqueFd fd, std::vector<uint8_t> raw);
    // On the handshake thread: it reads nothing of this object, only the
    // `tls` and `multifd` of the attempt it was started for (a copy: a
    // new migrate-incoming may replace params_ while it runs).
    static Result<std::vector<uint8_t>> tls_identify(const UniqueFd &fd, std::vector<uint8_t> raw,
                                                     const TlsParams &tls, bool multifd,
                                                     TlsHandshakes::Progress &progress,
                                                     std::unique_ptr<TlsSession> *session);
    // `ended`: handshakes_ ended it (a stranger past its deadline). `ch`
    // carries its TLS session when the handshake went through.
    void tls_ready(uint64_t generation, std::unique_ptr<Channel> ch,
                   Result<std::vector<uint8_t>> prefix, bool ended);
    // Active, the channels all there: as QEMU 10, any further connection
    // is ignored (the caller closes it), whatever it says, so a stranger
    // cannot end the migration. One that looks like a channel of this
    // source is remembered (Outcome::ignored): should the migration
    // then fail, its error says so.
    void extra_connection(const std::vector<uint8_t> &prefix);
    // Setup: a multifd init that is not one of ours (wrong UUID, channel
    // id out of range or taken) is closed and remembered, not fatal: a
    // misconfigured source then fails the wait for its channels, saying it.
    void ignore_connection(const Error &why);
    // `err` with what was ignored (Outcome::ignored), if anything was.
    Error with_ignored(const Error &err) const;
    Status open_mapped_ram(const MigrationAddress &addr, int fd);
    // The listener's end of setting up (SocketListener::OnListening).
    void listening(const Status &st);
    void maybe_start();
    void set_status(MigrationStatus s);
    void fail_setup(const Error &err);
    // The loop's own channels go: the listener and the TLS handshakes (an
    // attempt's channels close with it).
    void cleanup_channels();
    // The attempt's threads are joined (or never started): its channels
    // close, its counters go into outcome_, and it goes.
    void end_attempt();
    void finish(std::optional<Error> err, std::string runstate);
    // `run` is still the current attempt (it expires once end_attempt() drops it).
    bool current(const std::weak_ptr<IncomingAttempt> &run) const;

    // Postcopy preempt (QEMU's postcopy_preempt_new_channel()): with
    // postcopy-preempt, the first connection after the main channel is
    // taken at accept, by its order as QEMU does (it sends nothing until a
    // page goes on it), and read by a thread of the attempt.
    bool take_preempt(PendingConnection *c);
    // migrate-recover's first connection: the paused load's new main channel.
    bool take_recovered(PendingConnection *c);
    // Loop thread, after a failed or cancelled park: its images go.
    void park_discard();

    // IncomingOwner: what the attempt's threads post to the loop.
    void post_end(std::weak_ptr<IncomingAttempt> run, std::optional<Error> err,
                  std::string runstate, std::optional<ParkedVm> parked) override;
    void post_status(std::weak_ptr<IncomingAttempt> run, MigrationStatus from,
                     MigrationStatus to) override;
    void post_blocks(std::shared_ptr<IncomingAttempt> run, std::vector<RAMBlock> made) override;
    void post_pause(std::weak_ptr<IncomingAttempt> run) override;
    // Any thread: runs fn on the loop unless this object is gone by then
    // (the daemon quits: the dispatcher may still run what the threads
    // posted before the destructor joined them).
    void post_to_loop(std::function<void()> fn);

    uv_loop_t *loop_;
    LoopDispatcher &dispatcher_;
    // The daemon's blocks. The loop writes the list (a park's blocks are
    // appended by post_blocks(), dropped by park_discard());
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
    RateLimitedLog tls_failed_log_; // failed handshakes
    RateLimitedLog ignored_log_;    // connections ignored once identified
    uint64_t generation_ = 0; // a new migrate-incoming or cleanup: late results are dropped
    // Loop thread only: written at start() (the attempt keeps a copy, and
    // each handshake thread a copy of what it needs).
    IncomingParams params_;
    // The current attempt, from migrate-incoming until its threads are
    // joined (end_attempt()); null before and after. A new migrate-incoming
    // makes a new one, so nothing per run is reset by hand. Loop thread
    // only: the attempt's threads hold their own object (its `this`),
    // never this pointer.
    std::shared_ptr<IncomingAttempt> run_;
    // What query-migrate, /metrics and the daemon's runstate read of the
    // last attempt once it is gone (its counters while it runs come from
    // run_). Loop thread only; reset by start().
    struct Outcome {
        std::string runstate = "inmigrate"; // the source's globalstate, once complete
        std::string error_desc;
        // Why the first connection ignored once it had identified itself
        // was (ignore_connection(), extra_connection()); empty if none.
        std::string ignored;
        // The parked VM once complete: the load thread hands it over with
        // post_end().
        std::optional<ParkedVm> parked;
        IncomingCounts counts;
    };
    Outcome outcome_;
    // Expires with this object: what post_to_loop() checks on the loop.
    std::shared_ptr<const bool> alive_ = std::make_shared<const bool>(true);
};

} // namespace qmigd
