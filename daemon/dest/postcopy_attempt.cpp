// IncomingAttempt's postcopy beyond the main stream (QEMU's
// postcopy_preempt_thread() and postcopy_pause_incoming()): the preempt
// channel's reader, and a load that pauses on a broken channel and goes on
// over the channel migrate-recover accepts.
#include "daemon/dest/incoming_attempt.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>

#include <spdlog/spdlog.h>

#include "daemon/dest/image_load_handler.h"
#include "daemon/io/socket_channels.h"
#include "daemon/socket_io.h"
#include "daemon/thread_name.h"

namespace qmigd {

// The status follows the postcopy: active at the package's LISTEN, and
// again once a recovery's first page came.
void IncomingAttempt::watch_postcopy(ImageLoadHandler &handler)
{
    if (params_.postcopy_ram) {
        handler.set_postcopy(&received_, [this] {
            owner_.post_status(weak_from_this(), MigrationStatus::PostcopyRecover,
                               MigrationStatus::PostcopyActive);
        });
    }
    handler.set_on_listen([this] {
        postcopy_listening_ = true;
        spdlog::info("incoming migration: postcopy: the device state is in, the rest of RAM "
                     "follows");
        owner_.post_status(weak_from_this(), MigrationStatus::Active,
                           MigrationStatus::PostcopyActive);
    });
}

// In postcopy a failure pauses: the guest may run at the source's
// destination... and here the stream goes on over a new channel.
Result<LoadvmResult> IncomingAttempt::load_postcopy(LoadvmSession &session,
                                                      ImageLoadHandler &handler,
                                                      Result<LoadvmResult> result)
{
    std::unique_ptr<FdInputStream> rin;
    std::unique_ptr<QEMUFileReader> rf;
    for (;;) {
        while (!result && session.in_postcopy()) {
            bytes_.fetch_add(rf ? rf->pos() : 0, std::memory_order_relaxed);
            (void)handler.flush(); // whole pages read so far count as received
            auto ch = postcopy_pause_incoming(result.error());
            if (!ch) {
                result = ch.error();
                break;
            }
            rin = std::make_unique<FdInputStream>(**ch, std::vector<uint8_t>{});
            rf = std::make_unique<QEMUFileReader>(*rin, 256 * 1024);
            auto rp = ReturnPathOut::open(**ch, rp_writes_);
            if (!rp) {
                result = rp.error();
                break;
            }
            rp_ = std::move(*rp);
            result = session.resume(*rf);
        }
        // The preempt channel's pages are in once its reader ends: at the
        // source's end marker when the stream ended well (a page may still
        // be on its way behind the main channel's end), else at once. A
        // migrate-pause meanwhile pauses: a page may be missing.
        if (!end_preempt(bool(result)) || !result) {
            break;
        }
        result = Error("paused by migrate-pause before the postcopy preempt channel's end marker");
    }
    if (rf) {
        bytes_.fetch_add(rf->pos(), std::memory_order_relaxed);
    }
    return result;
}

bool IncomingAttempt::take_preempt(PendingConnection *c)
{
    if (!main_) {
        return false;
    }
    MutexLock lk(preempt_mu_);
    if (preempt_ended_ || preempt_) {
        return false; // a stranger, as any other connection
    }
    auto fd = c->take_socket();
    if (!fd) {
        return true;
    }
    set_link_timeout(fd->get(), params_.link_timeout_ms);
    preempt_ = std::make_unique<Channel>(std::move(*fd));
    preempt_done_ = preempt_used_ = false;
    preempt_thread_ = std::thread([this, ch = preempt_.get()] {
        set_thread_name("mig/dst/preempt");
        preempt_thread_main(ch);
    });
    spdlog::info("incoming migration: postcopy preempt channel connected");
    return true;
}

// QEMU's postcopy_preempt_thread(): the pages a source sends ahead of
// the main channel, into the same images (a page goes on one channel
// only, so the two never write the same one) and into the received
// bitmaps (a recovery tells the source about them too), until the source's
// end marker (QEMU's postcopy_preempt_shutdown_file()).
void IncomingAttempt::preempt_thread_main(Channel *ch)
{
    Status st = preempt_load(ch);
    if (!st) {
        preempt_failed(st.error());
    }
    {
        MutexLock lk(preempt_mu_);
        preempt_done_ = true;
    }
    preempt_cv_.notify_all(); // Pairs with the wait in end_preempt()
}

Status IncomingAttempt::preempt_load(Channel *ch)
{
    const std::vector<RamBlockDesc> *descs = packet_blocks();
    if (!descs) {
        return {}; // aborted before the blocks were known
    }
    LoadvmConfig cfg;
    cfg.blocks = *descs;
    // The first byte is waited for without taking it off the socket:
    // end_preempt() drains a channel the source sent on, known by
    // preempt_used_ or by bytes still queued, so the flag is set while the
    // bytes are still there (a read first left a moment where neither was
    // true, and the main stream's end then cut a page off).
    struct pollfd pfd = {ch->fd(), POLLIN, 0};
    while (poll(&pfd, 1, -1) < 0 && errno == EINTR) {
    }
    if (bytes_queued(ch->fd()) > 0) {
        MutexLock lk(preempt_mu_);
        preempt_used_ = true; // the source sends on it: end_preempt() drains it
    }
    FdInputStream in(*ch, {});
    QEMUFileReader f(in, 64 * 1024);
    std::unique_ptr<ReturnPathOut> no_rp;
    ImageLoadHandler handler(
        blocks_, nullptr, nullptr, {},
        [] { return Status(Error("OPEN_RETURN_PATH on the preempt channel")); }, no_rp);
    if (params_.postcopy_ram) {
        handler.set_postcopy(&received_, {});
    }
    auto r = qemu_load_preempt_channel(f, cfg, handler);
    Status st = handler.flush(); // whole pages read before an error count too
    bytes_.fetch_add(f.pos(), std::memory_order_relaxed);
    if (r) {
        normal_pages_.fetch_add(r->normal_pages);
        zero_pages_.fetch_add(r->zero_pages);
        spdlog::info("incoming migration: postcopy preempt channel: the source's end marker");
    }
    return r ? st : r.status();
}

// An error on the preempt channel. QEMU's preempt thread pauses on any;
// here the whole load pauses (its main channel shut down, as by
// migrate-pause), so that both sides recover together over new channels,
// whoever broke it (a cut link, or a stranger that took the preempt slot
// while a recovery waited for the source's). A channel this side ended is
// expected to break; before the package's LISTEN there is nothing to
// pause, and once the main stream ended (end_preempt()'s drain) a page
// may be lost: those fail the load.
void IncomingAttempt::preempt_failed(const Error &err)
{
    Error why = Error(err).prepend("postcopy preempt channel: ");
    bool ended, fail;
    {
        MutexLock lk(preempt_mu_);
        ended = preempt_ended_;
        fail = !postcopy_listening_ || preempt_draining_;
    }
    if (ended) {
        spdlog::debug("incoming migration: {} (ended here)", why.message());
        return;
    }
    if (fail) {
        abort_with(why); // takes preempt_mu_
        return;
    }
    spdlog::error("incoming migration: {}: pausing the postcopy", why.message());
    owner_.post_pause(weak_from_this());
}

// `drain` (the load thread, once the main stream ended well): a channel
// the source sends on is read to its end marker first (an EOS record:
// QEMU's postcopy_preempt_shutdown_file(), which a qmigd source sends and
// a QEMU 10 source only with x-preempt-pre-7-2), so that no page still on
// a slow link is lost; a source that sends none is waited for up to the
// link timeout. A channel that carried nothing is shut at once, as QEMU 10
// does: a QEMU 10 or qmigd source sends only the pages a destination asks
// for on it, and a qmigd destination asks for none. abort_with() ends the
// wait at any time (it shuts the channel down), and so does migrate-pause
// (pause()): then the load pauses, as it would on the main channel.
bool IncomingAttempt::end_preempt(bool drain)
{
    std::thread t;
    bool paused = false;
    {
        MutexLock lk(preempt_mu_);
        if (drain && preempt_thread_.joinable() &&
            (preempt_used_ || bytes_queued(preempt_->fd()) > 0)) {
            preempt_draining_ = true;
            auto until = std::chrono::steady_clock::now() +
                         std::chrono::milliseconds(params_.link_timeout_ms);
            while (!preempt_done_ && !pause_requested_) {
                if (!params_.link_timeout_ms) {
                    lk.wait(preempt_cv_);
                } else if (!lk.wait_until(preempt_cv_, until)) {
                    break;
                }
            }
            paused = !preempt_done_ && pause_requested_;
            if (paused) {
                spdlog::info("incoming migration: paused while waiting for the postcopy preempt "
                             "channel's end marker");
            } else if (!preempt_done_) {
                spdlog::warn("incoming migration: no end marker on the postcopy preempt "
                             "channel within {} ms: shut down",
                             params_.link_timeout_ms);
            }
        }
        preempt_ended_ = true;
        if (preempt_) {
            preempt_->shutdown();
        }
        t = std::move(preempt_thread_);
    }
    if (t.joinable()) {
        t.join();
    }
    MutexLock lk(preempt_mu_);
    preempt_.reset(); // its reader is joined
    return paused;
}

// postcopy_pause_incoming(): the broken channel and its return path go;
// the pages read so far are in the images and in received_.
Result<Channel *> IncomingAttempt::postcopy_pause_incoming(const Error &why)
{
    spdlog::error("incoming migration: Detected IO failure for postcopy. Migration paused: {}",
                  why.message());
    rp_.reset();
    end_preempt();
    {
        MutexLock lk(preempt_mu_);
        preempt_ended_ = false; // the resumed source connects it again
        preempt_draining_ = false;
        pause_requested_ = false; // this is the pause
    }
    owner_.post_status(weak_from_this(), MigrationStatus::PostcopyActive,
                       MigrationStatus::PostcopyPaused);
    owner_.post_status(weak_from_this(), MigrationStatus::PostcopyRecover,
                       MigrationStatus::PostcopyPaused);
    MutexLock lk(recover_mu_);
    while (!recover_new_ && !recover_abort_) {
        lk.wait(recover_cv_);
    }
    if (recover_abort_) {
        return Error(why).prepend("postcopy given up while paused: ");
    }
    recover_new_ = false;
    return recovered_.get();
}

void IncomingAttempt::take_recovered(UniqueFd fd)
{
    {
        // The previous recovery's channel goes (the load thread dropped
        // it when it paused); main_'s stays open, shut, until the attempt goes.
        MutexLock lk(recover_mu_);
        current_main()->shutdown();
        recovered_ = std::make_unique<Channel>(std::move(fd));
        recover_new_ = true;
    }
    recover_cv_.notify_all();
}

void IncomingAttempt::pause()
{
    {
        // The load thread may be past the main stream, waiting for the
        // preempt channel's end marker (end_preempt()): that wait ends too.
        MutexLock lk(preempt_mu_);
        pause_requested_ = true;
    }
    preempt_cv_.notify_all();
    if (main_) {
        MutexLock lk(recover_mu_);
        current_main()->shutdown();
    }
}

Channel *IncomingAttempt::current_main()
{
    return recovered_ ? recovered_.get() : main_->ch.get();
}

} // namespace qmigd
