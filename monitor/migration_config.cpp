#include "monitor/migration_config.h"

#include <algorithm>

namespace qmigd {

namespace {

// The capabilities qmigd implements; the rest are listed (false) and refused.
const std::vector<std::string> kImplementedCaps = {"multifd", "events", "auto-converge"};

QmpError type_error(const std::string &key, const char *type)
{
    return {"GenericError", "Parameter '" + key + "' expects " + type};
}

// QEMU's uint64 visitor takes any JSON integer and wraps negatives.
std::optional<uint64_t> as_uint64(const json &v)
{
    if (v.is_number_unsigned()) {
        return v.get<uint64_t>();
    }
    if (v.is_number_integer()) {
        return uint64_t(v.get<int64_t>());
    }
    return std::nullopt;
}

std::string underscored(std::string s)
{
    std::replace(s.begin(), s.end(), '-', '_');
    return s;
}

QmpError range_error(const std::string &key, uint64_t lo, const std::string &hi)
{
    return {"GenericError", "Parameter '" + underscored(key) + "' expects an integer in the "
                                                               "range of " +
                                std::to_string(lo) + " to " + hi};
}

} // namespace

MigrationConfig::MigrationConfig()
{
    params_ = {
        {"announce-initial", 50},
        {"announce-max", 550},
        {"announce-rounds", 5},
        {"announce-step", 100},
        {"avail-switchover-bandwidth", 0},
        {"cpu-throttle-increment", 10},
        {"cpu-throttle-initial", 20},
        {"cpu-throttle-tailslow", false},
        {"direct-io", false},
        {"downtime-limit", 300},
        {"max-bandwidth", 134217728},
        {"max-cpu-throttle", 99},
        {"max-postcopy-bandwidth", 0},
        {"mode", "normal"},
        {"multifd-channels", 2},
        {"multifd-compression", "none"},
        {"multifd-qatzip-level", 1},
        {"multifd-zlib-level", 1},
        {"multifd-zstd-level", 1},
        {"throttle-trigger-threshold", 50},
        {"tls-authz", ""},
        {"tls-creds", ""},
        {"tls-hostname", ""},
        {"vcpu-dirty-limit", 1},
        {"x-checkpoint-delay", 20000},
        {"x-vcpu-dirty-limit-period", 1000},
        {"xbzrle-cache-size", 67108864},
        {"zero-page-detection", "multifd"},
    };
    caps_.assign(capability_names().size(), false);
}

const std::vector<std::string> &MigrationConfig::capability_names()
{
    static const std::vector<std::string> names = {
        "xbzrle",         "rdma-pin-all",     "auto-converge",       "zero-blocks",
        "events",         "postcopy-ram",     "x-colo",              "release-ram",
        "return-path",    "pause-before-switchover", "multifd",      "dirty-bitmaps",
        "postcopy-blocktime", "late-block-activate", "x-ignore-shared", "validate-uuid",
        "background-snapshot", "zero-copy-send", "postcopy-preempt", "switchover-ack",
        "dirty-limit",    "mapped-ram",
    };
    return names;
}

json MigrationConfig::capabilities() const
{
    json list = json::array();
    for (size_t i = 0; i < caps_.size(); i++) {
        list.push_back({{"capability", capability_names()[i]}, {"state", bool(caps_[i])}});
    }
    return list;
}

bool MigrationConfig::capability(const std::string &name) const
{
    const auto &names = capability_names();
    auto it = std::find(names.begin(), names.end(), name);
    return it != names.end() && caps_[size_t(it - names.begin())];
}

std::optional<QmpError> MigrationConfig::set_capabilities(const json &args)
{
    if (!args.contains("capabilities")) {
        return QmpError{"GenericError", "Parameter 'capabilities' is missing"};
    }
    const json &list = args["capabilities"];
    if (!list.is_array()) {
        return QmpError{"GenericError",
                        "Invalid parameter type for 'capabilities', expected: array"};
    }
    std::vector<bool> next = caps_;
    const auto &names = capability_names();
    for (size_t i = 0; i < list.size(); i++) {
        std::string at = "capabilities[" + std::to_string(i) + "]";
        const json &item = list[i];
        if (!item.is_object()) {
            return QmpError{"GenericError",
                            "Invalid parameter type for '" + at + "', expected: object"};
        }
        if (!item.contains("capability")) {
            return QmpError{"GenericError", "Parameter '" + at + ".capability' is missing"};
        }
        if (!item["capability"].is_string()) {
            return QmpError{"GenericError", "Invalid parameter type for '" + at +
                                                ".capability', expected: string"};
        }
        if (!item.contains("state")) {
            return QmpError{"GenericError", "Parameter '" + at + ".state' is missing"};
        }
        if (!item["state"].is_boolean()) {
            return QmpError{"GenericError",
                            "Invalid parameter type for '" + at + ".state', expected: boolean"};
        }
        std::string name = item["capability"];
        auto it = std::find(names.begin(), names.end(), name);
        if (it == names.end()) {
            return QmpError{"GenericError",
                            "Parameter 'capability' does not accept value '" + name + "'"};
        }
        bool state = item["state"];
        if (state && std::find(kImplementedCaps.begin(), kImplementedCaps.end(), name) ==
                         kImplementedCaps.end()) {
            return QmpError{"GenericError",
                            "Capability '" + name + "' is not supported by qmigd"};
        }
        next[size_t(it - names.begin())] = state;
    }
    caps_ = next;
    return std::nullopt;
}

ZeroPageDetection MigrationConfig::zero_page_detection() const
{
    const std::string &v = params_["zero-page-detection"].get_ref<const std::string &>();
    return v == "none" ? ZeroPageDetection::None
           : v == "legacy" ? ZeroPageDetection::Legacy
                           : ZeroPageDetection::Multifd;
}

std::optional<QmpError> MigrationConfig::check_parameter(const std::string &key,
                                                         const json &v, json *out) const
{
    auto enum_check = [&](std::initializer_list<const char *> values) -> std::optional<QmpError> {
        if (!v.is_string()) {
            return QmpError{"GenericError",
                            "Invalid parameter type for '" + key + "', expected: string"};
        }
        std::string s = v;
        if (std::none_of(values.begin(), values.end(), [&](const char *x) { return s == x; })) {
            return QmpError{"GenericError",
                            "Parameter '" + key + "' does not accept value '" + s + "'"};
        }
        *out = v;
        return std::nullopt;
    };
    auto uint_check = [&](uint64_t lo, uint64_t hi, const std::string &hi_text,
                          const char *type) -> std::optional<QmpError> {
        auto n = as_uint64(v);
        if (!n) {
            return type_error(key, "uint64");
        }
        if (std::string(type) == "uint8_t" && *n > 255) {
            return type_error(key, "uint8_t");
        }
        if (*n < lo || *n > hi) {
            return range_error(key, lo, hi_text);
        }
        *out = *n;
        return std::nullopt;
    };

    if (key == "multifd-channels") {
        auto n = as_uint64(v);
        if (!n) {
            return type_error(key, "uint64");
        }
        if (*n > 255) {
            return type_error(key, "uint8_t");
        }
        if (*n == 0) {
            return QmpError{"GenericError",
                            "Parameter 'multifd_channels' expects a value between 1 and 255"};
        }
        *out = *n;
        return std::nullopt;
    }
    if (key == "zero-page-detection") {
        return enum_check({"none", "legacy", "multifd"});
    }
    if (key == "multifd-compression") {
        if (auto e = enum_check({"none", "zlib", "zstd", "qpl", "uadk", "qatzip"})) {
            return e;
        }
        if (v != "none") {
            return QmpError{"GenericError", "multifd-compression '" + v.get<std::string>() +
                                                "' is not supported by qmigd (only 'none')"};
        }
        return std::nullopt;
    }
    if (key == "max-bandwidth") {
        return uint_check(0, UINT64_MAX, "", "uint64");
    }
    if (key == "downtime-limit") {
        return uint_check(0, 2000000, "(2000 * 1000) ms", "uint64");
    }
    if (key == "cpu-throttle-initial" || key == "cpu-throttle-increment" ||
        key == "max-cpu-throttle") {
        return uint_check(1, 99, "99", "uint8_t");
    }
    if (key == "block-bitmap-mapping") { // listed by QEMU only once set
        if (!v.is_array()) {
            return QmpError{"GenericError",
                            "Invalid parameter type for 'block-bitmap-mapping', expected: array"};
        }
        *out = v;
        return std::nullopt;
    }
    if (key == "mode") {
        return enum_check({"normal", "cpr-reboot", "cpr-transfer"});
    }
    if (!params_.contains(key)) {
        return QmpError{"GenericError", "Parameter '" + key + "' is unexpected"};
    }
    // Parameters qmigd stores but does not act on: same JSON type as QEMU's.
    const json &def = params_[key];
    bool same = (def.is_number() && (v.is_number_integer() || v.is_number_unsigned())) ||
                (def.is_string() && v.is_string()) || (def.is_boolean() && v.is_boolean()) ||
                (def.is_array() && v.is_array());
    if (!same) {
        return QmpError{"GenericError", "Invalid parameter type for '" + key + "', expected: " +
                                            std::string(def.is_number()    ? "integer"
                                                        : def.is_string()  ? "string"
                                                        : def.is_boolean() ? "boolean"
                                                                           : "array")};
    }
    *out = v;
    return std::nullopt;
}

std::optional<QmpError> MigrationConfig::set_parameters(const json &args)
{
    json next = params_;
    for (auto it = args.begin(); it != args.end(); ++it) {
        json normalized;
        if (auto e = check_parameter(it.key(), it.value(), &normalized)) {
            return e;
        }
        next[it.key()] = normalized;
    }
    params_ = std::move(next);
    return std::nullopt;
}

} // namespace qmigd
