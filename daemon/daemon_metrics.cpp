// The daemon's side of --metrics: what a scrape reads, gathered on the
// loop thread (daemon/service/metrics_server.h serves it).
#include "daemon/daemon.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include "monitor/metrics.h"

namespace qmigd {

namespace {

// Idle scrapers must not take the descriptors the monitor and a migration
// need: under a low RLIMIT_NOFILE the connection cap leaves room for a
// listener's strangers (ListenerLimits::max_pending), the channels, the
// monitor's clients and the images.
MetricsLimits metrics_limits()
{
    MetricsLimits limits;
    constexpr uint64_t kReserved = 256 + 128;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        uint64_t room = rl.rlim_cur > kReserved + 16 ? rl.rlim_cur - kReserved : 16;
        limits.connections = unsigned(std::min<uint64_t>(limits.connections, room));
    }
    return limits;
}

// VmRSS and Threads of /proc/self/status, read through a descriptor opened
// at start: after --chroot there is no /proc to open, and after --runas
// the process may not be allowed to.
void process_figures(int status_fd, MetricsInput &in)
{
    char buf[8192];
    ssize_t n = status_fd >= 0 ? ::pread(status_fd, buf, sizeof buf - 1, 0) : -1;
    buf[n > 0 ? n : 0] = '\0';
    for (const char *line = buf; line; line = std::strchr(line, '\n')) {
        line += *line == '\n'; // past the previous line's end
        unsigned long long value;
        if (std::sscanf(line, "VmRSS: %llu", &value) == 1) {
            in.resident_bytes = value << 10;
        } else if (std::sscanf(line, "Threads: %llu", &value) == 1) {
            in.threads = value;
        }
    }
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
        in.cpu_seconds = double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                         double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
    }
}

} // namespace

// A migration that ended: its figures stay in /metrics until the next one
// starts (KubeVirt lost finished migrations' downtime to exactly that gap).
void Daemon::keep_last_migration(MigrationStatus s)
{
    if (s == MigrationStatus::Setup) {
        last_query_ = json::object(); // a new one started
        last_end_unix_ = 0;
        return;
    }
    if (s != MigrationStatus::Completed && s != MigrationStatus::Failed &&
        s != MigrationStatus::Cancelled) {
        return;
    }
    last_query_ = incoming_ ? incoming_->query() : outgoing_->query();
    last_end_unix_ = std::chrono::duration<double>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
}

std::string Daemon::metrics_text() const
{
    MetricsInput in;
    in.role = opts_.role == Role::Source ? "source" : "destination";
    in.version = QMIGD_VERSION;
    in.current = incoming_ ? incoming_->query() : outgoing_->query();
    in.last = last_query_;
    in.last_end_unix = last_end_unix_;
    for (const auto &b : blocks_) {
        const PagePaths &p = b.image->page_paths();
        in.page_paths.emplace_back(
            b.desc.idstr, opts_.role == Role::Source ? page_access_name(p.read)
                                                     : page_access_name(p.write));
    }
    process_figures(proc_status_fd_.get(), in);
    return prometheus_metrics(in);
}

Status Daemon::start_metrics()
{
    if (opts_.metrics.empty()) {
        return {};
    }
    // Before --chroot and --runas, which would hide it (Daemon::start).
    proc_status_fd_.reset(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
    if (!proc_status_fd_) {
        spdlog::warn("metrics: /proc/self/status: {}: the process figures read 0",
                     std::strerror(errno));
    }
    metrics_ = std::make_unique<MetricsServer>(*dispatcher_, [this] { return metrics_text(); },
                                               metrics_limits());
    return metrics_->start(opts_.metrics);
}

} // namespace qmigd
