#include "monitor/migration_config.h"

#include <algorithm>

namespace qmigd {

namespace {

// The capabilities qmigd implements; the rest are listed (false) and
// refused, each saying why (docs/monitor.md, "Capabilities").
const std::vector<std::string> kImplementedCaps = {
    "multifd", "events", "auto-converge", "mapped-ram", "return-path", "postcopy-ram",
    "postcopy-preempt", "pause-before-switchover", "switchover-ack", "validate-uuid",
    "x-ignore-shared", "zero-copy-send", "xbzrle", "dirty-bitmaps", "late-block-activate",
    "zero-blocks", "postcopy-blocktime"};

// Why qmigd refuses the others: what each needs that qmigd has not.
const std::vector<std::pair<std::string, std::string>> kRefusedCaps = {
    {"release-ram", "the source keeps every page until the destination has it all (a parked "
                    "VM's directory stays untouched, and a paused postcopy resends from it)"},
    {"x-colo", "COLO runs the VM on both sides at once, and qmigd runs no vCPU"},
    {"rdma-pin-all", "qmigd has no rdma: transport"},
    {"background-snapshot", "it write-protects the guest's memory inside its own QEMU; a "
                            "qmigd source cannot stop the writes of another process"},
    {"dirty-limit", "it limits vCPUs through KVM's dirty ring; qmigd throttles its guest with "
                    "auto-converge"},
};

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

// QEMU 10's integer parameters: the QAPI width (checked first, naming the
// parameter with dashes), then migrate_params_check()'s range (naming it
// with underscores, in one of a few phrasings). Measured against QEMU 10.0.
enum class Width { U8, U32, U64 };
enum class Phrase {
    Range,    // "expects an integer in the range of LO to HI"
    Between,  // "expects a value between LO and HI"
    PowerOf2, // xbzrle-cache-size
    AtLeast1, // vcpu-dirty-limit
};

struct IntParam {
    const char *key;
    Width width;
    uint64_t lo, hi;
    Phrase phrase;
    const char *text_lo; // as QEMU prints the bounds (not always lo/hi)
    const char *text_hi;
    bool dashed = false; // QEMU names this one with dashes in the range error
};

const IntParam kIntParams[] = {
    {"announce-initial", Width::U64, 0, 100000, Phrase::Between, "0", "100000"},
    {"announce-max", Width::U64, 0, 100000, Phrase::Between, "0", "100000"},
    {"announce-rounds", Width::U64, 0, 1000, Phrase::Between, "0", "1000"},
    {"announce-step", Width::U64, 1, 10000, Phrase::Between, "0", "10000"},
    {"avail-switchover-bandwidth", Width::U64, 0, UINT64_MAX, Phrase::Range, "", ""},
    {"cpu-throttle-increment", Width::U8, 1, 99, Phrase::Range, "1", "99"},
    {"cpu-throttle-initial", Width::U8, 1, 99, Phrase::Range, "1", "99"},
    {"downtime-limit", Width::U64, 0, 2000000, Phrase::Range, "0", "(2000 * 1000) ms"},
    {"max-bandwidth", Width::U64, 0, UINT64_MAX, Phrase::Range, "", ""},
    // Its lower bound is cpu-throttle-initial: checked on the merged set.
    {"max-cpu-throttle", Width::U8, 0, 99, Phrase::Range, "cpu_throttle_initial", "99"},
    {"max-postcopy-bandwidth", Width::U64, 0, UINT64_MAX, Phrase::Range, "", ""},
    {"multifd-channels", Width::U8, 1, 255, Phrase::Between, "1", "255"},
    {"multifd-qatzip-level", Width::U8, 1, 9, Phrase::Between, "1", "9"},
    {"multifd-zlib-level", Width::U8, 0, 9, Phrase::Between, "0", "9"},
    {"multifd-zstd-level", Width::U8, 0, 20, Phrase::Between, "0", "20"},
    {"throttle-trigger-threshold", Width::U8, 1, 100, Phrase::Range, "1", "100"},
    {"vcpu-dirty-limit", Width::U64, 1, UINT64_MAX, Phrase::AtLeast1, "", ""},
    {"x-checkpoint-delay", Width::U32, 0, UINT32_MAX, Phrase::Range, "", ""},
    {"x-vcpu-dirty-limit-period", Width::U64, 1, 1000, Phrase::Between, "1", "1000", true},
    {"xbzrle-cache-size", Width::U64, 4096, UINT64_MAX, Phrase::PowerOf2, "", ""},
};

const IntParam *find_int_param(const std::string &key)
{
    for (const auto &p : kIntParams) {
        if (key == p.key) {
            return &p;
        }
    }
    return nullptr;
}

QmpError int_range_error(const IntParam &p)
{
    std::string name = p.dashed ? p.key : underscored(p.key);
    std::string what;
    switch (p.phrase) {
    case Phrase::Range:
        what = std::string("expects an integer in the range of ") + p.text_lo + " to " + p.text_hi;
        break;
    case Phrase::Between:
        what = std::string("expects a value between ") + p.text_lo + " and " + p.text_hi;
        break;
    case Phrase::PowerOf2:
        what = "expects a power of two no less than the target page size";
        break;
    case Phrase::AtLeast1:
        what = "must be greater than 1 MB/s";
        break;
    }
    return {"GenericError", "Parameter '" + name + "' " + what};
}

std::optional<QmpError> check_int_param(const IntParam &p, const json &v, json *out)
{
    auto n = as_uint64(v);
    if (!n) {
        return type_error(p.key, "uint64");
    }
    if (p.width == Width::U8 && *n > UINT8_MAX) {
        return type_error(p.key, "uint8_t");
    }
    if (p.width == Width::U32 && *n > UINT32_MAX) {
        return type_error(p.key, "uint32_t");
    }
    bool bad = *n < p.lo || *n > p.hi ||
               (p.phrase == Phrase::PowerOf2 && (*n & (*n - 1)) != 0);
    if (bad) {
        return int_range_error(p);
    }
    *out = *n;
    return std::nullopt;
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
        for (const auto &[refused, why] : kRefusedCaps) {
            if (state && name == refused) {
                return QmpError{"GenericError",
                                "Capability '" + name + "' is not supported by qmigd: " + why};
            }
        }
        if (state && std::find(kImplementedCaps.begin(), kImplementedCaps.end(), name) ==
                         kImplementedCaps.end()) {
            return QmpError{"GenericError",
                            "Capability '" + name + "' is not supported by qmigd"};
        }
        next[size_t(it - names.begin())] = state;
    }
    if (auto e = check_combination(next)) {
        return e;
    }
    caps_ = next;
    return std::nullopt;
}

// migrate_caps_check(): the combinations QEMU 10 refuses, in its order and
// words. Capabilities qmigd refuses outright never get here.
std::optional<QmpError> MigrationConfig::check_combination(const std::vector<bool> &caps) const
{
    const auto &names = capability_names();
    auto on = [&](std::string_view name) {
        return caps[size_t(std::find(names.begin(), names.end(), name) - names.begin())];
    };
    auto refuse = [](std::string text) -> std::optional<QmpError> {
        return QmpError{"GenericError", std::move(text)};
    };
    if (on("postcopy-ram") && on("x-ignore-shared")) {
        return refuse("Postcopy is not compatible with ignore-shared");
    }
    if (on("postcopy-ram") && on("multifd")) {
        return refuse("Postcopy is not yet compatible with multifd");
    }
    if (on("zero-copy-send") && (!on("multifd") || on("xbzrle") ||
                                 multifd_compression() != "none" || tls())) {
        return refuse("Zero copy only available for non-compressed non-TLS multifd migration");
    }
    if (on("postcopy-preempt") && !on("postcopy-ram")) {
        return refuse("Postcopy preempt requires postcopy-ram");
    }
    if (on("switchover-ack") && !on("return-path")) {
        return refuse("Capability 'switchover-ack' requires capability 'return-path'");
    }
    if (on("multifd") && on("xbzrle")) {
        return refuse("Multifd is not compatible with xbzrle");
    }
    if (on("mapped-ram") && on("xbzrle")) {
        return refuse("Mapped-ram migration is incompatible with xbzrle");
    }
    if (on("mapped-ram") && on("postcopy-ram")) {
        return refuse("Mapped-ram migration is incompatible with postcopy");
    }
    return std::nullopt;
}

const std::string &MigrationConfig::zero_page_detection() const
{
    return params_["zero-page-detection"].get_ref<const std::string &>();
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
    if (const IntParam *ip = find_int_param(key)) {
        return check_int_param(*ip, v, out);
    }
    if (key == "zero-page-detection") {
        return enum_check({"none", "legacy", "multifd"});
    }
    if (key == "multifd-compression") {
        // QEMU 10 as Debian builds it: qpl, uadk and qatzip are compiled
        // out, so its schema does not know them.
        return enum_check({"none", "zlib", "zstd"});
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
    // migrate_params_check() on the merged set.
    if (next["max-cpu-throttle"].get<uint64_t>() < next["cpu-throttle-initial"].get<uint64_t>()) {
        return int_range_error(*find_int_param("max-cpu-throttle"));
    }
    // What is being set, not the merged set, as QEMU.
    bool sets_compression = args.contains("multifd-compression") &&
                            next["multifd-compression"] != "none";
    bool sets_tls = args.contains("tls-creds") && !next["tls-creds"].get<std::string>().empty();
    if (capability("zero-copy-send") && (sets_compression || sets_tls)) {
        return QmpError{"GenericError",
                        "Zero copy only available for non-compressed non-TLS multifd migration"};
    }
    params_ = std::move(next);
    return std::nullopt;
}

} // namespace qmigd
