// HMP through `human-monitor-command`: the text view of migration, built
// only from QMP results (as QEMU's migration-hmp-cmds.c does).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "monitor/qmp_server.h"

namespace qmigd {

// A migration URI's parse error, if any (the daemon's parser: monitor/
// knows no transports).
using HmpUriCheck = std::function<std::optional<std::string>(const std::string &uri)>;

// Registers human-monitor-command on top of the server's QMP commands;
// uri_check, if given, is what migrate_incoming parses its URI with first.
void hmp_register(QmpServer &server, HmpUriCheck uri_check = nullptr);

// `info migrate` text from a query-migrate result, lines ending in \r\n.
std::string hmp_format_info_migrate(const json &info);
std::string hmp_format_info_migrate_parameters(const json &params);
std::string hmp_format_info_migrate_capabilities(const json &caps);
std::string hmp_format_info_status(const json &status);
std::string hmp_format_info_version(const json &version);

} // namespace qmigd
