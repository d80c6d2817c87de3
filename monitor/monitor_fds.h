// QEMU's monitor file descriptors: `getfd` names a descriptor the client
// passed with SCM_RIGHTS, `closefd` closes one, and an fd:NAME migration
// URI takes one (monitor_fd_param). This is how libvirt hands QEMU an
// already-connected migration socket. Loop thread only.
#pragma once

#include <map>
#include <string>

#include "monitor/qmp_server.h"
#include "protocol/error.h"

namespace qmigd {

class MonitorFds {
public:
    // Registers getfd and closefd on `server`.
    explicit MonitorFds(QmpServer &server);
    ~MonitorFds();
    MonitorFds(const MonitorFds &) = delete;
    MonitorFds &operator=(const MonitorFds &) = delete;

    // A descriptor getfd named: removed from the table, now the caller's
    // (QEMU's monitor_get_fd). With `numbers` also a decimal number, a
    // descriptor this process already has, e.g. inherited (QEMU's
    // monitor_fd_param; QEMU 10 allows it for migrate-incoming only).
    Result<int> take(const std::string &name, bool numbers);

private:
    QmpResult getfd(const json &args);
    QmpResult closefd(const json &args);

    QmpServer &server_;
    std::map<std::string, int> fds_;
};

} // namespace qmigd
