// The migration parameter `mode` at migrate and migrate-incoming: what
// QEMU 10 checks for cpr-reboot and cpr-transfer, and what qmigd refuses.
#include "daemon/daemon.h"

namespace qmigd {

namespace {

// The `cpr` entry of `channels` (types checked already), or null.
const json *cpr_channel(const json &args)
{
    if (!args.contains("channels")) {
        return nullptr;
    }
    for (const json &ch : args["channels"]) {
        if (ch["channel-type"] == "cpr") {
            return &ch;
        }
    }
    return nullptr;
}

} // namespace

const std::string &Daemon::migration_mode() const
{
    return config_.parameters()["mode"].get_ref<const std::string &>();
}

// qmp_migrate(), after the address: the end of
// migration_transport_compatible() (cpr-transfer streams), then the cpr
// channel that cpr-transfer names in `channels` (a uri cannot).
std::optional<QmpError> Daemon::check_mode_channels(const MigrationAddress &addr,
                                                    const json &args) const
{
    if (migration_mode() != "cpr-transfer") {
        return std::nullopt;
    }
    if (addr.transport == MigrationAddress::Transport::File) {
        return QmpError{"GenericError", "Migration requires streamable transport (eg unix)"};
    }
    if (!cpr_channel(args)) {
        return QmpError{"GenericError", "missing 'cpr' migration channel"};
    }
    return std::nullopt;
}

// migrate_prepare()'s CPR conflicts (background-snapshot and COLO are
// refused as capabilities already), cpr_state_save()'s check of the cpr
// channel's address, then what qmigd cannot do. cpr-reboot
// is a migration with the guest stopped from the start, which a qmigd
// source does; cpr-transfer sends no RAM: the new QEMU maps the guest's
// memory from descriptors passed on the cpr channel, in QEMU's CPR state.
std::optional<QmpError> Daemon::check_mode_migrate(const json &args) const
{
    const std::string &mode = migration_mode();
    if (mode != "normal" && config_.capability("postcopy-ram")) {
        return QmpError{"GenericError", "Cannot use postcopy with CPR"};
    }
    if (mode == "cpr-transfer") {
        // cpr_state_save(), next: the cpr channel must be a unix socket.
        const json &cpr = (*cpr_channel(args))["addr"];
        if (cpr.value("transport", "") != "socket" || cpr.value("type", "") != "unix") {
            return QmpError{"GenericError", "bad cpr channel address; must be unix"};
        }
        return QmpError{"GenericError",
                        "qmigd: migration mode cpr-transfer is not supported: it sends no RAM "
                        "and passes the guest's memory-backend descriptors to a new QEMU in "
                        "QEMU's CPR state on the cpr channel, which qmigd does not write; use "
                        "mode normal, or cpr-reboot"};
    }
    return std::nullopt;
}

// A cpr-reboot stream is an ordinary one (QEMU's destination loads it as
// any); a cpr-transfer stream has no page of RAM, which a QEMU destination
// maps from the descriptors its start read on the cpr channel.
std::optional<QmpError> Daemon::check_mode_incoming() const
{
    if (migration_mode() == "cpr-transfer") {
        return QmpError{"GenericError",
                        "qmigd: migration mode cpr-transfer is not supported: its stream "
                        "carries no RAM (a new QEMU maps the guest's memory from descriptors "
                        "passed on the cpr channel at its start), so qmigd's images would "
                        "stay empty; use mode normal, or cpr-reboot"};
    }
    return std::nullopt;
}

} // namespace qmigd
