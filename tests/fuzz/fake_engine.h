// A monitor wired to a fake migration engine for the fuzz targets: the real
// QmpServer dispatch, MigrationConfig and HMP, with migrate/query-migrate
// answered from a small state machine instead of a daemon. No sockets.
#pragma once

#include <string>

#include <uv.h>

#include "daemon/io/socket_channels.h"
#include "monitor/hmp.h"
#include "monitor/migration_config.h"
#include "monitor/qapi_visit.h"
#include "monitor/qmp_server.h"

namespace qmigd {

// The fake's migrate takes a uri only (no channels).
inline const QapiType kFakeMigrateArgs = qapi_struct(
    {{"uri", &kQapiStr, true}, {"detach", &kQapiBool, true}, {"resume", &kQapiBool, true}});

struct FakeEngine {
    uv_loop_t loop;
    QmpServer server{&loop};
    MigrationConfig config;
    std::string status = "none";
    std::string error_desc; // may hold any bytes, as from a broken peer

    FakeEngine()
    {
        uv_loop_init(&loop);
        const QapiType *none = &kQapiNoArgs;
        server.register_command("query-status", none, [](const json &) -> QmpResult {
            return json{{"status", "running"}, {"running", true}};
        });
        server.register_command("migrate-set-parameters", &MigrationConfig::set_parameters_args(),
                                [this](const json &a) -> QmpResult {
                                    if (auto e = config.set_parameters(a)) {
                                        return *e;
                                    }
                                    return json::object();
                                });
        server.register_command("migrate-set-capabilities", &MigrationConfig::set_capabilities_args(),
                                [this](const json &a) -> QmpResult {
                                    if (auto e = config.set_capabilities(a)) {
                                        return *e;
                                    }
                                    return json::object();
                                });
        server.register_command("query-migrate-parameters", none,
                                [this](const json &) -> QmpResult { return config.parameters(); });
        server.register_command("query-migrate-capabilities", none,
                                [this](const json &) -> QmpResult { return config.capabilities(); });
        server.register_command("query-migrate", none, [this](const json &) -> QmpResult {
            if (status == "none") {
                return json::object();
            }
            return json{{"status", status}, {"error-desc", error_desc}};
        });
        server.register_command("migrate", &kFakeMigrateArgs,
                                [this](const json &a) -> QmpResult {
                                    if (!a.contains("uri")) {
                                        return qmp_error("need either 'uri' or 'channels' argument");
                                    }
                                    auto addr = parse_socket_uri(a["uri"]);
                                    if (!addr) {
                                        status = "failed";
                                        error_desc = a["uri"].get<std::string>();
                                        return qmp_error(addr.error().message());
                                    }
                                    status = "active";
                                    return json::object();
                                });
        server.register_command("migrate_cancel", none, [this](const json &) -> QmpResult {
            status = status == "active" ? "cancelled" : status;
            return json::object();
        });
        hmp_register(server);
    }
    ~FakeEngine()
    {
        server.close();
        uv_run(&loop, UV_RUN_DEFAULT);
        uv_loop_close(&loop);
    }
};

} // namespace qmigd
