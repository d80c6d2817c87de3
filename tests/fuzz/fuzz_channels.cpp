// libFuzzer target: the `channels` argument of migrate/migrate-incoming.
// Any JSON goes through QEMU's QAPI check; what passes is turned into an
// address or an error for both roles, never a crash or an uncaught throw.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "daemon/io/migration_address.h"
#include "monitor/qapi_visit.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    std::string text(reinterpret_cast<const char *>(data), size);
    auto channels = nlohmann::json::parse(text, nullptr, false);
    if (channels.is_discarded()) {
        return 0;
    }
    if (qapi_check(channels, migration_channel_list_type(), "channels", "channels")) {
        return 0;
    }
    for (bool incoming : {false, true}) {
        auto a = migration_channels_address(channels, incoming);
        if (a.ok()) {
            (void)a->uri();
            (void)check_transport_for_multifd(*a, true, false);
            (void)check_transport_for_multifd(*a, false, true);
        }
    }
    auto uri = parse_migration_uri(text);
    (void)uri;
    return 0;
}
