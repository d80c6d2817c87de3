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
    if (address[0] == '@') {
        address[0] = '\0';
    }
    int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        spdlog::warn("NOTIFY_SOCKET: socket: {}", std::strerror(errno));
        return nullptr;
    }
    return std::unique_ptr<ServiceNotifier>(new ServiceNotifier(fd, address, watchdog));
}

ServiceNotifier::~ServiceNotifier() { ::close(fd_); }

void ServiceNotifier::send(const std::string &state)
{
    sockaddr_un sa = {};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, address_.data(), address_.size());
    socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + address_.size() +
                              (address_[0] == '\0' ? 0 : 1));
    // Never waits: a manager whose queue is full (512 datagrams unread)
    // must not stop the loop that sends (its pings are dropped instead).
    if (::sendto(fd_, state.data(), state.size(), MSG_NOSIGNAL | MSG_DONTWAIT,
                 reinterpret_cast<const sockaddr *>(&sa), len) < 0) {
        spdlog::debug("NOTIFY_SOCKET: {}", std::strerror(errno));
    }
}

} // namespace qmigd
