// Telling a service manager how the daemon is doing: the notify socket and its datagrams.
#include "daemon/service/service_notify.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

namespace qmigd {

namespace {

// $WATCHDOG_USEC if it is meant for this process.
uint64_t watchdog_from_environment()
{
    const char *usec = std::getenv("WATCHDOG_USEC");
    const char *pid = std::getenv("WATCHDOG_PID");
    if (!usec || (pid && std::strtoll(pid, nullptr, 10) != getpid())) {
        return 0;
    }
    char *end = nullptr;
    unsigned long long v = std::strtoull(usec, &end, 10);
    return end && *end == '\0' ? uint64_t(v) : 0;
}

// A datagram socket connected to `address` (a path, or \0NAME) now, while
// the path is reachable: after --chroot it is not, and after --runas the
// new user may not write to it. None (said in the log) if it cannot be.
UniqueFd connect_manager(const std::string &address, const std::string &given)
{
    UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd) {
        spdlog::warn("NOTIFY_SOCKET: socket: {}", std::strerror(errno));
        return fd;
    }
    sockaddr_un sa = {};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, address.data(), address.size());
    socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + address.size() +
                              (address[0] == '\0' ? 0 : 1));
    if (::connect(fd.get(), reinterpret_cast<const sockaddr *>(&sa), len) < 0) {
        spdlog::warn("NOTIFY_SOCKET '{}': {}: the service manager will not hear from qmigd",
                     given, std::strerror(errno));
        return UniqueFd();
    }
    return fd;
}

} // namespace

std::unique_ptr<ServiceNotifier> ServiceNotifier::from_environment()
{
    const char *env = std::getenv("NOTIFY_SOCKET");
    std::string address = env ? env : "";
    uint64_t watchdog = watchdog_from_environment();
    ::unsetenv("NOTIFY_SOCKET");
    ::unsetenv("WATCHDOG_USEC");
    ::unsetenv("WATCHDOG_PID");
    if (address.empty() || address.size() >= sizeof(sockaddr_un::sun_path) ||
        (address[0] != '/' && address[0] != '@')) {
        if (!address.empty()) {
            spdlog::warn("NOTIFY_SOCKET '{}' is neither a path nor an abstract name: ignored",
                         address);
        }
        return nullptr;
    }
    const std::string given = address;
    if (address[0] == '@') {
        address[0] = '\0';
    }
    UniqueFd fd = connect_manager(address, given);
    if (!fd) {
        return nullptr;
    }
    return std::unique_ptr<ServiceNotifier>(new ServiceNotifier(std::move(fd), watchdog));
}

void ServiceNotifier::send(const std::string &state)
{
    if (::send(fd_.get(), state.data(), state.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
        spdlog::debug("NOTIFY_SOCKET: {}", std::strerror(errno));
    }
}

} // namespace qmigd
