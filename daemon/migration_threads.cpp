// The listed migration threads and query-migrationthreads.
#include "daemon/migration_threads.h"

#include <algorithm>
#include <unistd.h>

#include "daemon/thread_safety.h"
#include "monitor/qapi_visit.h"

namespace qmigd {

namespace {

// Listed threads, oldest first; any thread adds and removes itself, the
// loop reads a copy.
struct ThreadList {
    Mutex mu;
    std::vector<MigrationThreadInfo> threads GUARDED_BY(mu);
};

ThreadList &thread_list()
{
    static ThreadList list;
    return list;
}

} // namespace

ListedMigrationThread::ListedMigrationThread(std::string name) : thread_id_(int(gettid()))
{
    ThreadList &l = thread_list();
    MutexLock lock(l.mu);
    l.threads.push_back({std::move(name), thread_id_});
}

ListedMigrationThread::~ListedMigrationThread()
{
    ThreadList &l = thread_list();
    MutexLock lock(l.mu);
    auto it = std::find_if(l.threads.begin(), l.threads.end(),
                           [this](const MigrationThreadInfo &t) { return t.thread_id == thread_id_; });
    if (it != l.threads.end()) {
        l.threads.erase(it);
    }
}

std::vector<MigrationThreadInfo> migration_threads()
{
    ThreadList &l = thread_list();
    MutexLock lock(l.mu);
    return {l.threads.rbegin(), l.threads.rend()};
}

void register_migration_threads_command(QmpServer &server)
{
    server.register_command("query-migrationthreads", &kQapiNoArgs, [](const json &) -> QmpResult {
        json list = json::array();
        for (const auto &t : migration_threads()) {
            list.push_back({{"name", t.name}, {"thread-id", t.thread_id}});
        }
        return list;
    });
}

} // namespace qmigd
