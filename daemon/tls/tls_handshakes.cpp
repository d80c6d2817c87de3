#include "daemon/tls/tls_handshakes.h"

#include <unistd.h>

#include <spdlog/spdlog.h>

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

void TlsHandshakes::start(int fd, Work work)
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
    e.fd = fd;
    e.started_ms = uv_now(loop_);
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

TlsHandshakes::Entry *TlsHandshakes::to_evict()
{
    Entry *pick = nullptr;
    for (Entry &e : entries_) {
        if (e.ended) {
            continue;
        }
        if (!pick) {
            pick = &e;
            continue;
        }
        bool a = e.progress.identifying.load(), b = pick->progress.identifying.load();
        uint64_t ea = e.progress.bytes.load(), eb = pick->progress.bytes.load();
        // Entries are in start order: a later one only wins by the rule.
        if ((a && !b) || (a == b && !a && ea < eb)) {
            pick = &e;
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
