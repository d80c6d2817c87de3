// yank on a destination: every channel of the incoming migration shut down.
#include "daemon/dest/incoming.h"
#include "daemon/dest/incoming_attempt.h"

#include <spdlog/spdlog.h>

namespace qmigd {

// QEMU's yank shuts each registered channel down and sets no error of its
// own: the load ends on its reads' failure. In postcopy that pauses it:
// migrate-pause's path, which leaves the multifd channels be (they carry
// nothing in postcopy, and a receive thread's error would fail the load
// that a recovery can still save). While the channels are still the
// loop's (setup), nothing reads them yet.
void IncomingMigration::yank()
{
    if (migration_in_postcopy(status_)) {
        pause();
        return;
    }
    if (!loading()) {
        return;
    }
    run_->yank();
}

void IncomingAttempt::yank()
{
    if (main_) {
        MutexLock lk(recover_mu_);
        current_main()->shutdown();
    }
    shutdown_side_channels();
}

} // namespace qmigd
