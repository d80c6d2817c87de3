// query-yank and yank (QEMU 10's util/yank.c): the instances a client may
// yank, and the yank itself: every channel of the instance shut down at once.
#include "daemon/daemon.h"

#include <spdlog/spdlog.h>

#include "monitor/qapi_visit.h"

namespace qmigd {

namespace {

// qapi/yank.json of QEMU 10.0: YankInstance, a flat union on `type`.
const QapiType kYankInstanceType = qapi_enum({"block-node", "chardev", "migration"});
const QapiType kYankBlockNode = qapi_struct({{"node-name", &kQapiStr}});
const QapiType kYankChardev = qapi_struct({{"id", &kQapiStr}});
const QapiType kYankInstance =
    qapi_flat_union("type", &kYankInstanceType,
                    {{"block-node", &kYankBlockNode},
                     {"chardev", &kYankChardev},
                     {"migration", &kQapiNoArgs}});
const QapiType kYankInstanceList = qapi_list_of(&kYankInstance);
const QapiType kYankArgs = qapi_struct({{"instances", &kYankInstanceList}});

// The monitor's socket, as QEMU names the chardev -qmp makes.
constexpr const char *kMonitorChardev = "compat_monitor0";

} // namespace

// QEMU registers the migration instance at migrate (the source) and
// migrate-incoming or -incoming (the destination), and drops it when the
// migration has ended: while it runs, a paused postcopy included.
bool Daemon::yank_migration_registered() const
{
    return (outgoing_ && migration_is_running(outgoing_->status())) ||
           (incoming_ && migration_is_running(incoming_->status()));
}

// In registration order, as query-yank lists them: the monitor's chardev
// first (made at start), then the migration.
json Daemon::query_yank() const
{
    json list = json::array({{{"type", "chardev"}, {"id", kMonitorChardev}}});
    if (yank_migration_registered()) {
        list.push_back({{"type", "migration"}});
    }
    return list;
}

// qmp_yank(): every instance must exist before any is yanked.
QmpResult Daemon::cmd_yank(const json &args)
{
    const json &instances = args["instances"];
    for (const json &inst : instances) {
        const std::string &type = inst["type"].get_ref<const std::string &>();
        bool found = type == "migration" ? yank_migration_registered()
                                         : type == "chardev" && inst["id"] == kMonitorChardev;
        if (!found) {
            return qmp_error("Instance not found", "DeviceNotFound");
        }
    }
    for (const json &inst : instances) {
        if (inst["type"] == "migration") {
            spdlog::warn("migration: yanked: every channel shut down");
            if (outgoing_) {
                outgoing_->yank();
            }
            if (incoming_) {
                incoming_->yank();
            }
        } else {
            qmp_->drop_clients(); // no reply reaches the client, as QEMU's
        }
    }
    return json::object();
}

void Daemon::register_yank_commands()
{
    qmp_->register_command(
        "query-yank", &kQapiNoArgs, [this](const json &) -> QmpResult { return query_yank(); },
        true);
    qmp_->register_command(
        "yank", &kYankArgs, [this](const json &a) { return cmd_yank(a); }, true);
}

} // namespace qmigd
