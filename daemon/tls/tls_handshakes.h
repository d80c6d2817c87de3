// The TLS handshakes of a destination's connections, each on a thread of
// its own (GnuTLS blocks), bounded and reaped.
//
// Whoever reaches the migration port can start one, so a handshake is a
// stranger's until it has identified itself as a migration channel: it
// has a deadline (handshake and first decrypted bytes, identify_ms from
// its start) and one of max_pending places. When a new one finds them all
// taken, one is ended (its socket shut down, which ends its thread): a
// peer that finished its handshake and has not said what it is (a source
// does so at once), the oldest first; else the peer that has sent the
// fewest bytes (read or still queued), the oldest among equals; a peer that
// has sent nothing yet counts for its first 250 ms as one that sent a TLS
// record header. A source's handshake has sent a whole ClientHello and
// more, so stalled ClientHellos evict each other, not it, however fast they
// come. Threads are joined as soon as they post their result, so none is
// left mapped.
//
// Thread ownership: the table, its entries and the timer belong to the loop
// thread, but for an Entry's Progress: its handshake thread writes it (atomics,
// read by the loop) and touches nothing else of the table; it posts its result
// to the loop and ends. An Entry's fd is borrowed: start()'s caller keeps the
// socket open until that result has run on the loop.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <thread>

#include <uv.h>

#include "daemon/io/socket_channels.h"
#include "daemon/loop_dispatcher.h"

namespace qmigd {

class TlsHandshakes {
public:
    // What a handshake's peer has done so far: written by its thread (the
    // session's reads), read by the loop when it must end one.
    struct Progress {
        std::atomic<uint64_t> bytes{0};       // received from the peer
        std::atomic<bool> identifying{false}; // handshake done, first bytes awaited
        // steady_clock ms when `identifying` was set (before it): a source
        // sends its first bytes at once, but "at once" is not zero time.
        std::atomic<int64_t> identifying_since_ms{0};
        void set_identifying();
        // Identifying for longer than a source ever takes: first to go.
        bool silent_after_handshake() const;
    };
    // Runs on the loop when a handshake thread is done; `ended`: this table
    // ended it (deadline, or evicted for a newer connection).
    using Then = std::function<void(bool ended)>;
    // Runs on the handshake thread; returns what to run on the loop then.
    // `progress` is the Entry's, for the session to update.
    using Work = std::function<Then(Progress &progress)>;

    TlsHandshakes(uv_loop_t *loop, LoopDispatcher &dispatcher, ListenerLimits limits);
    ~TlsHandshakes();
    TlsHandshakes(const TlsHandshakes &) = delete;
    TlsHandshakes &operator=(const TlsHandshakes &) = delete;

    // Loop thread. Runs work for the socket fd on a new thread. Its result
    // always reaches the loop, also after close_all() (the caller tells a
    // stale one by its own generation count). fd is the caller's, open
    // until that result has run (see above). `already_read`: the bytes the
    // listener took off the socket before (they count as the peer's from
    // now, not only once the thread has run).
    void start(const UniqueFd &fd, size_t already_read, Work work);
    // Loop thread. Ends every handshake (shuts their sockets) and joins
    // their threads.
    void close_all();
    size_t size() const { return entries_.size(); }

private:
    struct Entry {
        uint64_t id = 0;
        int fd = -1; // start()'s fd's number, a borrow (see above); end() shuts it down
        uint64_t started_ms = 0; // uv_now() at start, as the listener's clock
        uint64_t already_read = 0; // start()'s, which progress.bytes counts once the work reads it
        Progress progress;
        bool ended = false; // its socket was shut down
        std::thread thread;
    };

    // Joins the thread; whether this table had ended it.
    bool reap(uint64_t id);
    // The entry to end for a newcomer (see above).
    Entry *to_evict();
    static uint64_t bytes_sent_by_peer(const Entry &e);
    // How long a peer that has sent nothing yet counts as having sent a
    // record header (see to_evict()).
    static constexpr uint64_t kNewcomerGraceMs = 250;
    // Joins the threads of ended entries and drops them (a flood's way).
    void reap_ended();
    void end(Entry &e);
    void sweep();

    uv_loop_t *loop_;
    LoopDispatcher &dispatcher_;
    ListenerLimits limits_;
    uv_timer_t *timer_ = nullptr;
    std::list<Entry> entries_; // stable addresses: threads hold &progress
    uint64_t next_id_ = 0;
    DroppedStrangers dropped_;
};

} // namespace qmigd
