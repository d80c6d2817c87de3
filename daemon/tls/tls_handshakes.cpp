// TLS handshakes of a destination's connections: a thread each, bounded, evicted and reaped.
#include "daemon/tls/tls_handshakes.h"

#include <algorithm>
#include <sys/ioctl.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include "daemon/monotonic_clock.h"
#include "daemon/socket_io.h"
#include "daemon/thread_name.h"

namespace qmigd {

TlsHandshakes::TlsHandshakes(uv_loop_t *loop, LoopDispatcher &dispatcher, ListenerLimits limits)
    : loop_(loop), dispatcher_(dispatcher), limits_(limits)
{
}

TlsHandshakes::~TlsHandshakes()
{
    close_all();
}

void TlsHandshakes::start(const UniqueFd &fd, size_t already_read, Work work)
{
    size_t live = 0;
    for (const Entry &e : entries_) {
        live += !e.ended;
    }
    if (live >= limits_.max_pending) {
        dropped_.evicted++;
        end(*to_evict());
    }
    // Ended threads finish at once, but a flood can outrun their posts to
    // the loop: past twice the limit, the ended ones are joined here.
    if (entries_.size() >= 2 * limits_.max_pending) {
        reap_ended();
    }
    if (!timer_) {
        timer_ = sweeper_start(loop_, limits_, this, [](uv_timer_t *t) {
            static_cast<TlsHandshakes *>(t->data)->sweep();
        });
    }
    Entry &e = entries_.emplace_back();
    e.id = next_id_++;
    e.fd = fd.get();
    e.started_ms = uv_now(loop_);
    e.already_read = already_read;
    e.thread = std::thread([this, id = e.id, &progress = e.progress, work = std::move(work)] {
        set_thread_name("mig/dst/tls");
        Then then = work(progress);
        // Pairs with reap(): the loop joins this thread when it runs this.
        dispatcher_.post([this, id, then = std::move(then)] { then(reap(id)); });
    });
}

void TlsHandshakes::reap_ended()
{
    for (auto it = entries_.begin(); it != entries_.end();) {
        if (it->ended) {
            it->thread.join(); // its socket is shut down: it is on its way out
            it = entries_.erase(it); // its post finds no entry: reap() says ended
        } else {
            ++it;
        }
    }
}

namespace {

// A source's channel sends its first bytes right after its handshake; one
// that has not within this long is a stranger that only shook hands.
constexpr int64_t kIdentifyGraceMs = 50;

} // namespace

void TlsHandshakes::Progress::set_identifying()
{
    identifying_since_ms = monotonic_ms(); // Pairs with the acquire of `identifying` below.
    identifying.store(true, std::memory_order_release);
}

bool TlsHandshakes::Progress::silent_after_handshake() const
{
    return identifying.load(std::memory_order_acquire) &&
           monotonic_ms() - identifying_since_ms.load() >= kIdentifyGraceMs;
}

// Bytes the peer has sent: those the session read plus those still queued
// in the socket (the handshake thread may not have read its ClientHello yet).
uint64_t TlsHandshakes::bytes_sent_by_peer(const Entry &e)
{
    int queued = 0;
    if (ioctl(e.fd, FIONREAD, &queued) != 0 || queued < 0) {
        queued = 0;
    }
    return std::max(e.progress.bytes.load(), e.already_read) + uint64_t(queued);
}

// Which handshake a newcomer ends when all places are taken, in order:
// one that shook hands and stayed silent past the grace (the longest
// silent first); else the handshake whose peer sent the fewest bytes (a
// stalled ClientHello; the oldest of equals); else one within its grace.
// A source's channel is never first: it handshakes at full speed and
// identifies itself within the grace. A peer that has sent nothing yet
// counts, for its first kNewcomerGraceMs, as one that sent a TLS record
// header: a source sends its ClientHello right after connecting, but a busy
// host can take a while to run that thread, and a few bytes that stopped
// are a surer sign of a stall than none yet.
TlsHandshakes::Entry *TlsHandshakes::to_evict()
{
    constexpr uint64_t kRecordHeaderBytes = 5;
    uint64_t now = uv_now(loop_);
    Entry *pick = nullptr;
    int pick_rank = 3;
    uint64_t pick_bytes = 0;
    for (Entry &e : entries_) {
        if (e.ended) {
            continue;
        }
        int r = e.progress.silent_after_handshake() ? 0 : e.progress.identifying.load() ? 2 : 1;
        uint64_t bytes = bytes_sent_by_peer(e);
        if (bytes == 0 && now - e.started_ms < kNewcomerGraceMs) {
            bytes = kRecordHeaderBytes;
        }
        // Entries are in start order: a later one wins only by the rule.
        bool better = r < pick_rank || (r == pick_rank && r == 1 && bytes < pick_bytes);
        if (better) {
            pick = &e;
            pick_rank = r;
            pick_bytes = bytes;
        }
    }
    return pick;
}

bool TlsHandshakes::reap(uint64_t id)
{
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        if (it->id == id) {
            it->thread.join(); // it posted its result as its last act
            bool ended = it->ended;
            entries_.erase(it);
            return ended;
        }
    }
    return true; // close_all() joined it
}

void TlsHandshakes::end(Entry &e)
{
    if (!e.ended) {
        e.ended = true;
        shutdown_fd(e.fd); // the handshake's next read fails; the thread posts
    }
}

void TlsHandshakes::sweep()
{
    uint64_t now = uv_now(loop_);
    for (Entry &e : entries_) {
        if (!e.ended && now - e.started_ms >= limits_.identify_ms) {
            dropped_.expired++;
            end(e);
        }
    }
    dropped_.log("TLS connections", "those that did least went", limits_);
}

void TlsHandshakes::close_all()
{
    for (Entry &e : entries_) {
        end(e);
    }
    for (Entry &e : entries_) {
        e.thread.join(); // its result is posted; reap() finds nothing then
    }
    entries_.clear();
    if (timer_) {
        dropped_.log("TLS connections", "those that did least went", limits_);
        sweeper_close(&timer_);
    }
}

} // namespace qmigd
