// The destination's postcopy, the loop's side: the preempt channel taken
// at accept, migrate-recover's listener and new main channel, migrate-pause
// (the attempt's threads: postcopy_attempt.cpp).
#include "daemon/dest/incoming.h"

#include <spdlog/spdlog.h>

#include "daemon/io/migration_socket.h"

namespace qmigd {

bool IncomingMigration::take_preempt(PendingConnection *c)
{
    return params_.postcopy_preempt && loading() && run_->take_preempt(c);
}

bool IncomingMigration::take_recovered(PendingConnection *c)
{
    if (status_ != MigrationStatus::PostcopyPaused || !run_->has_main()) {
        return false;
    }
    auto fd = c->take_socket();
    if (!fd) {
        return true;
    }
    set_link_timeout(fd->get(), params_.link_timeout_ms);
    set_status(MigrationStatus::PostcopyRecover);
    spdlog::info("incoming migration: postcopy recovery: new main channel connected");
    run_->take_recovered(std::move(*fd));
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
        loop_, 4, [this](PendingConnection *c) { on_prefix(c); },
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
    run_->pause();
}

} // namespace qmigd
