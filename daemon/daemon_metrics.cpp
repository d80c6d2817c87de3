// The daemon's side of --metrics: what a scrape reads, gathered on the
// loop thread (daemon/service/metrics_server.h serves it).
#include "daemon/daemon.h"

#include <chrono>
#include <fstream>
#include <sys/resource.h>

#include "monitor/metrics.h"

namespace qmigd {

namespace {

// VmRSS and Threads of /proc/self/status.
void process_figures(MetricsInput &in)
{
    std::ifstream f("/proc/self/status");
    std::string key;
    uint64_t value;
    while (f >> key) {
        if (key == "VmRSS:" && f >> value) {
            in.resident_bytes = value << 10;
        } else if (key == "Threads:" && f >> value) {
            in.threads = value;
        }
        f.ignore(1 << 10, '\n');
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
    process_figures(in);
    return prometheus_metrics(in);
}

Status Daemon::start_metrics()
{
    if (opts_.metrics.empty()) {
        return {};
    }
    metrics_ = std::make_unique<MetricsServer>(*dispatcher_, [this] { return metrics_text(); });
    return metrics_->start(opts_.metrics);
}

} // namespace qmigd
