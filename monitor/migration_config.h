// Migration capabilities and parameters as QMP and HMP see them, with
// QEMU 10's defaults, types, ranges and error texts.
//
// Thread ownership: lives on the loop thread; the daemon copies what a
// migration needs when it starts (QEMU's channel-count crash on cancel is
// what happens when a running migration reads live parameters).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "monitor/qapi_visit.h"
#include "monitor/qmp_server.h"

namespace qmigd {

class MigrationConfig {
public:
    MigrationConfig();

    // query-migrate-parameters
    const json &parameters() const { return params_; }
    // query-migrate-capabilities
    json capabilities() const;
    // The commands' argument types in QEMU 10's schema: the monitor checks
    // `args` against them before the two setters below run.
    static const QapiType &set_parameters_args();
    static const QapiType &set_capabilities_args();
    // migrate-set-parameters: all or nothing; `args` of
    // set_parameters_args(). Ranges and combinations in QEMU's words.
    std::optional<QmpError> set_parameters(const json &args);
    // migrate-set-capabilities; `args` of set_capabilities_args().
    std::optional<QmpError> set_capabilities(const json &args);

    bool capability(const std::string &name) const;
    // Capability names in QEMU's order.
    static const std::vector<std::string> &capability_names();

    unsigned multifd_channels() const { return params_["multifd-channels"]; }
    // "none" | "legacy" | "multifd" (ramstate/zero_page.h parses it).
    const std::string &zero_page_detection() const;
    uint64_t max_bandwidth() const { return params_["max-bandwidth"]; }
    uint64_t max_postcopy_bandwidth() const { return params_["max-postcopy-bandwidth"]; }
    // "none" | "zlib" | "zstd" (protocol/multifd_compress.h parses it), and
    // the level of that method (multifd-zlib-level / multifd-zstd-level).
    const std::string &multifd_compression() const
    {
        return params_["multifd-compression"].get_ref<const std::string &>();
    }
    int multifd_compression_level() const
    {
        const std::string &m = multifd_compression();
        return m == "zstd" ? params_["multifd-zstd-level"].get<int>()
                           : params_["multifd-zlib-level"].get<int>();
    }
    // QEMU's migrate_direct_io(): the parameter counts only with mapped-ram
    // and multifd (the multifd channels are what O_DIRECT applies to).
    bool direct_io() const
    {
        return params_["direct-io"].get<bool>() && capability("mapped-ram") &&
               capability("multifd");
    }
    // QEMU's migrate_tls(): tls-creds is set.
    bool tls() const { return !params_["tls-creds"].get_ref<const std::string &>().empty(); }
    uint64_t xbzrle_cache_size() const { return params_["xbzrle-cache-size"]; }
    uint64_t downtime_limit_ms() const { return params_["downtime-limit"]; }
    unsigned cpu_throttle_initial() const { return params_["cpu-throttle-initial"]; }
    unsigned cpu_throttle_increment() const { return params_["cpu-throttle-increment"]; }
    unsigned max_cpu_throttle() const { return params_["max-cpu-throttle"]; }

private:
    std::optional<QmpError> check_combination(const std::vector<bool> &caps) const;
    std::optional<QmpError> check_parameter(const std::string &key, const json &value,
                                            json *normalized) const;

    json params_;
    std::vector<bool> caps_;
};

} // namespace qmigd
