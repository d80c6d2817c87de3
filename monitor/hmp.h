// HMP through `human-monitor-command`: the text view of migration, built
// only from QMP results (as QEMU's migration-hmp-cmds.c does).
#pragma once

#include <string>

#include "monitor/qmp_server.h"

namespace qmigd {

// Registers human-monitor-command on top of the server's QMP commands.
void hmp_register(QmpServer &server);

// `info migrate` text from a query-migrate result, lines ending in \r\n.
std::string hmp_format_info_migrate(const json &info);
std::string hmp_format_info_migrate_parameters(const json &params);
std::string hmp_format_info_migrate_capabilities(const json &caps);
std::string hmp_format_info_status(const json &status);
std::string hmp_format_info_version(const json &version);

} // namespace qmigd
