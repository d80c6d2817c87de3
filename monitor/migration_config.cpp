// Migration capabilities and parameters: their QMP and HMP views, ranges and combinations.
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

// QEMU 10's argument types (qapi/migration.json), members in its order,
// integers at their QAPI widths ('size' is a uint64).
const QapiType kCapabilityEnum = qapi_enum(MigrationConfig::capability_names());
const QapiType kCapabilityStatus =
    qapi_struct({{"capability", &kCapabilityEnum}, {"state", &kQapiBool}});
const QapiType kCapabilityStatusList = qapi_list_of(&kCapabilityStatus);
const QapiType kSetCapabilitiesArgs = qapi_struct({{"capabilities", &kCapabilityStatusList}});

const QapiType kBitmapTransform = qapi_struct({{"persistent", &kQapiBool, true}});
const QapiType kBitmapAlias = qapi_struct(
    {{"name", &kQapiStr}, {"alias", &kQapiStr}, {"transform", &kBitmapTransform, true}});
const QapiType kBitmapAliasList = qapi_list_of(&kBitmapAlias);
const QapiType kBitmapNodeAlias = qapi_struct(
    {{"node-name", &kQapiStr}, {"alias", &kQapiStr}, {"bitmaps", &kBitmapAliasList}});
const QapiType kBitmapNodeAliasList = qapi_list_of(&kBitmapNodeAlias);
// Debian's QEMU 10: qpl, uadk and qatzip are compiled out, so its schema
// does not know them.
const QapiType kCompressionEnum = qapi_enum({"none", "zlib", "zstd"});
const QapiType kModeEnum = qapi_enum({"normal", "cpr-reboot", "cpr-transfer"});
const QapiType kZeroPageEnum = qapi_enum({"none", "legacy", "multifd"});

const QapiType kSetParametersArgs = [] {
    const QapiType *size = &kQapiUint64, *u8 = &kQapiUint8, *str_or_null = &kQapiStrOrNull;
    std::vector<QapiType::Member> m = {
        {"announce-initial", size},        {"announce-max", size},
        {"announce-rounds", size},         {"announce-step", size},
        {"throttle-trigger-threshold", u8}, {"cpu-throttle-initial", u8},
        {"cpu-throttle-increment", u8},    {"cpu-throttle-tailslow", &kQapiBool},
        {"tls-creds", str_or_null},        {"tls-hostname", str_or_null},
        {"tls-authz", str_or_null},        {"max-bandwidth", size},
        {"avail-switchover-bandwidth", size}, {"downtime-limit", &kQapiUint64},
        {"x-checkpoint-delay", &kQapiUint32}, {"multifd-channels", u8},
        {"xbzrle-cache-size", size},       {"max-postcopy-bandwidth", size},
        {"max-cpu-throttle", u8},          {"multifd-compression", &kCompressionEnum},
        {"multifd-zlib-level", u8},        {"multifd-qatzip-level", u8},
        {"multifd-zstd-level", u8},        {"block-bitmap-mapping", &kBitmapNodeAliasList},
        {"x-vcpu-dirty-limit-period", &kQapiUint64}, {"vcpu-dirty-limit", &kQapiUint64},
        {"mode", &kModeEnum},              {"zero-page-detection", &kZeroPageEnum},
        {"direct-io", &kQapiBool}};
    for (auto &member : m) {
        member.optional = true;
    }
    return qapi_struct(std::move(m));
}();

std::string underscored(std::string s)
{
    std::replace(s.begin(), s.end(), '-', '_');
    return s;
}

// QEMU 10's integer parameters: migrate_params_check()'s range (naming it
// with underscores, in one of a few phrasings), once the QAPI visitor has
// checked the width (kSetParametersArgs). Measured against QEMU 10.0.
enum class Phrase {
    Range,    // "expects an integer in the range of LO to HI"
    Between,  // "expects a value between LO and HI"
    PowerOf2, // xbzrle-cache-size
    AtLeast1, // vcpu-dirty-limit
};

struct IntParam {
    const char *key;
    uint64_t lo, hi;
    Phrase phrase;
    const char *text_lo; // as QEMU prints the bounds (not always lo/hi)
    const char *text_hi;
    bool dashed = false; // QEMU names this one with dashes in the range error
};

const IntParam kIntParams[] = {
    {"announce-initial", 0, 100000, Phrase::Between, "0", "100000"},
    {"announce-max", 0, 100000, Phrase::Between, "0", "100000"},
    {"announce-rounds", 0, 1000, Phrase::Between, "0", "1000"},
    {"announce-step", 1, 10000, Phrase::Between, "0", "10000"},
    {"avail-switchover-bandwidth", 0, UINT64_MAX, Phrase::Range, "", ""},
    {"cpu-throttle-increment", 1, 99, Phrase::Range, "1", "99"},
    {"cpu-throttle-initial", 1, 99, Phrase::Range, "1", "99"},
    {"downtime-limit", 0, 2000000, Phrase::Range, "0", "(2000 * 1000) ms"},
    {"max-bandwidth", 0, UINT64_MAX, Phrase::Range, "", ""},
    // Its lower bound is cpu-throttle-initial: checked on the merged set.
    {"max-cpu-throttle", 0, 99, Phrase::Range, "cpu_throttle_initial", "99"},
    {"max-postcopy-bandwidth", 0, UINT64_MAX, Phrase::Range, "", ""},
    {"multifd-channels", 1, 255, Phrase::Between, "1", "255"},
    {"multifd-qatzip-level", 1, 9, Phrase::Between, "1", "9"},
    {"multifd-zlib-level", 0, 9, Phrase::Between, "0", "9"},
    {"multifd-zstd-level", 0, 20, Phrase::Between, "0", "20"},
    {"throttle-trigger-threshold", 1, 100, Phrase::Range, "1", "100"},
    {"vcpu-dirty-limit", 1, UINT64_MAX, Phrase::AtLeast1, "", ""},
    {"x-checkpoint-delay", 0, UINT32_MAX, Phrase::Range, "", ""},
    {"x-vcpu-dirty-limit-period", 1, 1000, Phrase::Between, "1", "1000", true},
    {"xbzrle-cache-size", 4096, UINT64_MAX, Phrase::PowerOf2, "", ""},
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

// `v` is an integer of the parameter's width (the visitor checked it);
// QEMU's uint64 takes negatives too, wrapped.
std::optional<QmpError> check_int_param(const IntParam &p, const json &v, json *out)
{
    uint64_t n = v.is_number_unsigned() ? v.get<uint64_t>() : uint64_t(v.get<int64_t>());
    bool bad = n < p.lo || n > p.hi || (p.phrase == Phrase::PowerOf2 && (n & (n - 1)) != 0);
    if (bad) {
        return int_range_error(p);
    }
    *out = n;
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

const QapiType &MigrationConfig::set_capabilities_args()
{
    return kSetCapabilitiesArgs;
}

const QapiType &MigrationConfig::set_parameters_args()
{
    return kSetParametersArgs;
}

std::optional<QmpError> MigrationConfig::set_capabilities(const json &args)
{
    const json &list = args["capabilities"];
    std::vector<bool> next = caps_;
    const auto &names = capability_names();
    for (const json &item : list) {
        std::string name = item["capability"];
        auto it = std::find(names.begin(), names.end(), name);
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

// One parameter, of its QAPI type already: the range of an integer, and
// QEMU's rewrite of a null tls-* to "" (qmp_migrate_set_parameters).
std::optional<QmpError> MigrationConfig::check_parameter(const std::string &key,
                                                         const json &v, json *out) const
{
    if (const IntParam *ip = find_int_param(key)) {
        return check_int_param(*ip, v, out);
    }
    *out = v.is_null() ? json("") : v;
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
