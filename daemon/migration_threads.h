// QEMU's migration_threads list (migration/threadinfo.c): the threads
// query-migrationthreads names, each with its Linux thread id.
#pragma once

#include <string>
#include <vector>

namespace qmigd {

class QmpServer;

struct MigrationThreadInfo {
    std::string name; // QEMU 10's: "mig/src/main", "mig/src/send_0", ...
    int thread_id = 0; // gettid()
};

// Lists the calling thread for its scope (migration_threads_add/_remove).
// QEMU 10.0 lists the source's migration thread and multifd senders only:
// not the return path, the destination's threads nor mig/dirtyrate.
class ListedMigrationThread {
public:
    explicit ListedMigrationThread(std::string name);
    ~ListedMigrationThread();
    ListedMigrationThread(const ListedMigrationThread &) = delete;
    ListedMigrationThread &operator=(const ListedMigrationThread &) = delete;

private:
    int thread_id_;
};

// The listed threads, newest first (QEMU inserts at the list's head).
std::vector<MigrationThreadInfo> migration_threads();

// query-migrationthreads on `server` (both roles; a destination's list is
// empty, as QEMU 10's is).
void register_migration_threads_command(QmpServer &server);

} // namespace qmigd
