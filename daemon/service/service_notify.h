// Telling a service manager how the daemon is doing: systemd's notify
// protocol (sd_notify(3)), spoken directly -- one datagram of
// "KEY=VALUE\n" lines to the socket in $NOTIFY_SOCKET -- so that qmigd
// needs no libsystemd and works under any manager that speaks it.
//
//   READY=1      the monitor listens (and a destination's --incoming too)
//   STATUS=...   the migration's state, one line for `systemctl status`
//   WATCHDOG=1   every half of $WATCHDOG_USEC, from the loop thread: a
//                loop that stops turning stops the pings
//   STOPPING=1   quit or a signal
//
// Thread ownership: the loop thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "daemon/io/unique_fd.h"
#include "protocol/error.h"

namespace qmigd {

class ServiceNotifier {
public:
    // From $NOTIFY_SOCKET (a path, or @NAME in the abstract namespace) and
    // $WATCHDOG_USEC (only if $WATCHDOG_PID is unset or ours), connected
    // at once: call it before --chroot and --runas. Null when no manager
    // asked, or its socket cannot be reached. Both are removed from the environment, so that
    // commands qmigd starts (exec:) do not talk to the manager as qmigd.
    static std::unique_ptr<ServiceNotifier> from_environment();

    // One datagram, never waiting for room: a manager that went away or
    // stopped reading is not an error of ours.
    void send(const std::string &state);
    // 0: no watchdog.
    uint64_t watchdog_usec() const { return watchdog_usec_; }

private:
    ServiceNotifier(UniqueFd fd, uint64_t watchdog_usec)
        : fd_(std::move(fd)), watchdog_usec_(watchdog_usec)
    {
    }

    UniqueFd fd_; // connected to the manager's socket
    uint64_t watchdog_usec_;
};

} // namespace qmigd
