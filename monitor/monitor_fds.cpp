// getfd and closefd: the monitor's named descriptors, taken by fd:NAME migrations.
#include "monitor/monitor_fds.h"

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <unistd.h>

#include "monitor/qapi_visit.h"

namespace qmigd {

namespace {

// getfd's and closefd's arguments (qapi/misc.json).
const QapiType kFdnameArgs = qapi_struct({{"fdname", &kQapiStr}});

} // namespace

MonitorFds::MonitorFds(QmpServer &server) : server_(server)
{
    server.register_command("getfd", &kFdnameArgs, [this](const json &a) { return getfd(a); });
    server.register_command("closefd", &kFdnameArgs, [this](const json &a) { return closefd(a); });
}

MonitorFds::~MonitorFds()
{
    for (auto &[name, fd] : fds_) {
        ::close(fd);
    }
}

QmpResult MonitorFds::getfd(const json &args)
{
    int fd = server_.take_client_fd();
    if (fd < 0) {
        return qmp_error("No file descriptor supplied via SCM_RIGHTS");
    }
    std::string name = args["fdname"];
    if (!name.empty() && std::isdigit(static_cast<unsigned char>(name[0]))) {
        ::close(fd);
        return qmp_error("Parameter 'fdname' expects a name not starting with a digit");
    }
    auto it = fds_.find(name);
    if (it != fds_.end()) {
        ::close(it->second); // QEMU replaces a descriptor of the same name
        it->second = fd;
    } else {
        fds_[name] = fd;
    }
    return json::object();
}

QmpResult MonitorFds::closefd(const json &args)
{
    std::string name = args["fdname"];
    auto it = fds_.find(name);
    if (it == fds_.end()) {
        return qmp_error("File descriptor named '" + name + "' not found");
    }
    ::close(it->second);
    fds_.erase(it);
    return json::object();
}

Result<int> MonitorFds::take(const std::string &name, bool numbers)
{
    if (numbers && !name.empty() && std::isdigit(static_cast<unsigned char>(name[0]))) {
        errno = 0;
        char *end = nullptr;
        long v = std::strtol(name.c_str(), &end, 10);
        if (errno || *end || v < 0 || v > INT_MAX) {
            return Error("Invalid file descriptor number '" + name + "'");
        }
        return int(v);
    }
    auto it = fds_.find(name);
    if (it == fds_.end()) {
        return Error("File descriptor named '" + name + "' has not been found");
    }
    int fd = it->second;
    fds_.erase(it);
    return fd;
}

} // namespace qmigd
