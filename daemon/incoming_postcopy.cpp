// The destination's postcopy beyond the main stream (QEMU's
// postcopy_preempt_thread(), postcopy_pause_incoming() and
// migrate-recover): the preempt channel, and a load that pauses on a
// broken channel and goes on over the channel migrate-recover accepts.
#include "daemon/incoming.h"

#include <unistd.h>

#include <spdlog/spdlog.h>

#include "daemon/image_load_handler.h"
#include "daemon/socket_io.h"
#include "daemon/thread_name.h"

namespace qmigd {

bool IncomingMigration::take_preempt(PendingConnection *c)
{
    if (!params_.postcopy_preempt || !main_ || !loading()) {
        return false;
    }
    std::lock_guard<std::mutex> lk(preempt_mu_);
    if (preempt_ended_ || preempt_fd_ >= 0) {
        return false; // a stranger, as any other connection
    }
    auto fd = c->take();
    if (!fd) {
        return true;
    }
    set_link_timeout(*fd, params_.link_timeout_ms);
    preempt_fd_ = *fd;
    preempt_thread_ = std::thread([this, fd = *fd] {
        set_thread_name("mig/dst/preempt");
        preempt_thread_main(fd);
    });
    spdlog::info("incoming migration: postcopy preempt channel connected");
    return true;
}

// QEMU's postcopy_preempt_thread(): the pages a source sends ahead of
// the main channel, into the same images (a page goes on one channel
// only, so the two never write the same one).
void IncomingMigration::preempt_thread_main(int fd)
{
    const std::vector<RamBlockDesc> *descs = packet_blocks();
    if (!descs) {
        return;
    }
    LoadvmConfig cfg;
    cfg.blocks = *descs;
    FdInputStream in(fd, {}, nullptr);
    QEMUFileReader f(in, 64 * 1024);
    std::unique_ptr<ReturnPathOut> no_rp;
    ImageLoadHandler handler(
        blocks_, nullptr, nullptr, {},
        [] { return Status(Error("OPEN_RETURN_PATH on the preempt channel")); }, no_rp);
    auto r = qemu_load_preempt_channel(f, cfg, handler);
    Status st = r ? handler.flush() : r.status();
    bytes_.fetch_add(f.pos(), std::memory_order_relaxed);
    if (r) {
        normal_pages_.fetch_add(r->normal_pages);
        zero_pages_.fetch_add(r->zero_pages);
    }
    if (!st) {
        abort_with(Error(st.error()).prepend("postcopy preempt channel: "));
    }
}

void IncomingMigration::end_preempt()
{
    std::thread t;
    {
        std::lock_guard<std::mutex> lk(preempt_mu_);
        preempt_ended_ = true;
        if (preempt_fd_ >= 0) {
            shutdown_fd(preempt_fd_);
        }
        t = std::move(preempt_thread_);
    }
    if (t.joinable()) {
        t.join();
    }
    std::lock_guard<std::mutex> lk(preempt_mu_);
    if (preempt_fd_ >= 0) {
        ::close(preempt_fd_);
        preempt_fd_ = -1;
    }
}

// postcopy_pause_incoming(): the broken channel and its return path go;
// the pages read so far are in the images and in received_.
Result<int> IncomingMigration::postcopy_pause_incoming(const Error &why)
{
    spdlog::error("incoming migration: Detected IO failure for postcopy. Migration paused: {}",
                  why.message());
    rp_.reset();
    end_preempt();
    {
        std::lock_guard<std::mutex> lk(preempt_mu_);
        preempt_ended_ = false; // the resumed source connects it again
    }
    dispatcher_.post([this] {
        if (status_ == MigrationStatus::PostcopyActive ||
            status_ == MigrationStatus::PostcopyRecover) {
            set_status(MigrationStatus::PostcopyPaused);
        }
    });
    std::unique_lock<std::mutex> lk(recover_mu_);
    recover_cv_.wait(lk, [this] { return recover_fd_ >= 0 || recover_abort_; });
    if (recover_abort_) {
        return Error(why).prepend("postcopy given up while paused: ");
    }
    int fd = recover_fd_;
    recover_fd_ = -1;
    return fd;
}

bool IncomingMigration::take_recovered(PendingConnection *c)
{
    if (status_ != MigrationStatus::PostcopyPaused || !main_) {
        return false;
    }
    auto fd = c->take();
    if (!fd) {
        return true;
    }
    set_link_timeout(*fd, params_.link_timeout_ms);
    ::close(main_->fd); // the load thread dropped it when it paused
    main_->fd = *fd;
    main_->prefix.clear();
    main_->tls.reset();
    set_status(MigrationStatus::PostcopyRecover);
    spdlog::info("incoming migration: postcopy recovery: new main channel connected");
    {
        std::lock_guard<std::mutex> lk(recover_mu_);
        recover_fd_ = *fd;
    }
    recover_cv_.notify_all();
    return true;
}

Status IncomingMigration::recover(const MigrationAddress &addr)
{
    if (addr.transport != MigrationAddress::Transport::Socket || params_.tls.enabled()) {
        return Error("qmigd: a postcopy migration recovers over tcp: or unix: without TLS only");
    }
    // migration_incoming_transport_cleanup(): the old listener goes.
    if (listener_) {
        listener_->close();
        listener_.reset();
    }
    listener_ = std::make_unique<SocketListener>(
        loop_, 4, [this](PendingConnection *c, const Error *e) { on_prefix(c, e); },
        stranger_limits());
    listener_->set_on_accept(
        [this](PendingConnection *c) { return take_recovered(c) || take_preempt(c); });
    auto on_listening = [this](const Status &st) {
        if (!st) {
            // The load stays paused: another migrate-recover may follow.
            spdlog::error("incoming migration: postcopy recovery: {}", st.error().message());
            listener_.reset();
            return;
        }
        spdlog::info("incoming migration: postcopy recovery: listening on {}",
                     listener_->address().uri());
    };
    QMIGD_TRY(listener_->listen(addr.socket, on_listening));
    if (!listener_->resolving()) {
        on_listening({});
    }
    return {};
}

void IncomingMigration::pause()
{
    spdlog::info("incoming migration: postcopy paused by migrate-pause");
    if (main_) {
        shutdown_fd(main_->fd);
    }
}

} // namespace qmigd
