// QAPI MigrationStatus values qmigd uses, with QEMU's names.
#pragma once

#include <string_view>

namespace qmigd {

enum class MigrationStatus {
    None,
    Setup,
    Cancelling,
    Cancelled,
    Active,
    PreSwitchover, // pause-before-switchover: the VM stopped, migrate-continue awaited
    Device,
    PostcopyActive,
    PostcopyPaused,
    PostcopyRecoverSetup,
    PostcopyRecover,
    Completed,
    Failed,
};

inline const char *migration_status_name(MigrationStatus s)
{
    switch (s) {
    case MigrationStatus::None: return "none";
    case MigrationStatus::Setup: return "setup";
    case MigrationStatus::Cancelling: return "cancelling";
    case MigrationStatus::Cancelled: return "cancelled";
    case MigrationStatus::Active: return "active";
    case MigrationStatus::PreSwitchover: return "pre-switchover";
    case MigrationStatus::Device: return "device";
    case MigrationStatus::PostcopyActive: return "postcopy-active";
    case MigrationStatus::PostcopyPaused: return "postcopy-paused";
    case MigrationStatus::PostcopyRecoverSetup: return "postcopy-recover-setup";
    case MigrationStatus::PostcopyRecover: return "postcopy-recover";
    case MigrationStatus::Completed: return "completed";
    case MigrationStatus::Failed: return "failed";
    }
    return "none";
}

// A migration is in progress (QEMU's migration_is_running()).
inline bool migration_is_running(MigrationStatus s)
{
    return s == MigrationStatus::Setup || s == MigrationStatus::Active ||
           s == MigrationStatus::PreSwitchover || s == MigrationStatus::Device || s == MigrationStatus::Cancelling ||
           s == MigrationStatus::PostcopyActive || s == MigrationStatus::PostcopyPaused ||
           s == MigrationStatus::PostcopyRecoverSetup || s == MigrationStatus::PostcopyRecover;
}

// Postcopy has started: the VM runs at the destination, and the source can
// no longer take it back (QEMU's migration_in_postcopy()).
inline bool migration_in_postcopy(MigrationStatus s)
{
    return s == MigrationStatus::PostcopyActive || s == MigrationStatus::PostcopyPaused ||
           s == MigrationStatus::PostcopyRecoverSetup || s == MigrationStatus::PostcopyRecover;
}

// migrate-pause applies (QEMU's migration_postcopy_is_alive()).
inline bool migration_postcopy_is_alive(MigrationStatus s)
{
    return s == MigrationStatus::PostcopyActive || s == MigrationStatus::PostcopyRecover;
}

} // namespace qmigd
