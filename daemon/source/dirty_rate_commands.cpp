// calc-dirty-rate's checks in QEMU 10's order and words, and query-dirty-rate's answer.
#include "daemon/source/dirty_rate_commands.h"

#include "monitor/qapi_visit.h"
#include "ramstate/dirty_rate.h"

namespace qmigd {

namespace {

const char *const kModes[] = {"page-sampling", "dirty-ring", "dirty-bitmap"};
const char *const kStatuses[] = {"unstarted", "measuring", "measured"};

// qapi/migration.json, members in its order.
const QapiType kTimeUnit = qapi_enum({"second", "millisecond"});
const QapiType kModeEnum = qapi_enum({kModes[0], kModes[1], kModes[2]});
const QapiType kCalcArgs = qapi_struct({{"calc-time", &kQapiInt},
                                        {"calc-time-unit", &kTimeUnit, true},
                                        {"sample-pages", &kQapiInt, true},
                                        {"mode", &kModeEnum, true}});
const QapiType kQueryArgs = qapi_struct({{"calc-time-unit", &kTimeUnit, true}});

// convert_time_unit() to milliseconds, wrapping as QEMU's int64 does.
int64_t to_ms(int64_t value, bool millisecond)
{
    return millisecond ? value : int64_t(uint64_t(value) * 1000);
}

DirtyRateMode mode_of(const json &args)
{
    std::string m = args.value("mode", std::string(kModes[0]));
    return m == kModes[2] ? DirtyRateMode::DirtyBitmap
                          : m == kModes[1] ? DirtyRateMode::DirtyRing : DirtyRateMode::PageSampling;
}

// qmp_calc_dirty_rate() after its first check (one measuring): the config, or its error.
std::variant<DirtyRateConfig, QmpError> calc_config(const json &args)
{
    DirtyRateConfig c;
    c.calc_time_ms = to_ms(args["calc-time"].get<int64_t>(),
                           args.value("calc-time-unit", "second") == std::string("millisecond"));
    if (c.calc_time_ms < kDirtyRateMinCalcMs || c.calc_time_ms > kDirtyRateMaxCalcMs) {
        return QmpError{"GenericError", "Calculation time is out of range [50ms, 60000ms]."};
    }
    c.mode = mode_of(args);
    bool has_samples = args.contains("sample-pages");
    if (has_samples && c.mode != DirtyRateMode::PageSampling) {
        return QmpError{"GenericError", "sample-pages is used only in page-sampling mode"};
    }
    int64_t samples = has_samples ? args["sample-pages"].get<int64_t>() : kDirtyRateDefaultSamplePages;
    if (samples < kDirtyRateMinSamplePages || samples > kDirtyRateMaxSamplePages) {
        return QmpError{"GenericError", "sample-pages is out of range[128, 16384]."};
    }
    c.sample_pages = uint64_t(samples);
    // A daemon has no KVM dirty ring, so dirty-bitmap is the one QEMU allows.
    if (c.mode == DirtyRateMode::DirtyRing) {
        return QmpError{"GenericError", "mode dirty-ring is not enabled, use other method instead."};
    }
    return c;
}

// query_dirty_rate_info().
json dirty_rate_info(const DirtyRateStat &s, bool millisecond)
{
    json info = {{"status", kStatuses[int(s.status)]},
                 {"start-time", s.start_time},
                 {"calc-time", millisecond ? s.calc_time_ms : s.calc_time_ms / 1000},
                 {"calc-time-unit", millisecond ? "millisecond" : "second"},
                 {"sample-pages", s.sample_pages},
                 {"mode", kModes[int(s.mode)]}};
    if (s.status == DirtyRateStatus::Measured) {
        info["dirty-rate"] = s.dirty_rate;
        if (s.mode != DirtyRateMode::PageSampling) {
            info["sample-pages"] = 0;
        }
    }
    return info;
}

} // namespace

std::unique_ptr<DirtyRateMeasure> register_dirty_rate_commands(QmpServer &server,
                                                               const std::vector<RAMBlock> &blocks)
{
    auto measure = std::make_unique<DirtyRateMeasure>(blocks);
    DirtyRateMeasure *m = measure.get();
    server.register_command("calc-dirty-rate", &kCalcArgs, [m](const json &args) -> QmpResult {
        if (m->stat().status == DirtyRateStatus::Measuring) {
            return qmp_error("the dirty rate is already being measured.");
        }
        auto config = calc_config(args);
        if (auto *e = std::get_if<QmpError>(&config)) {
            return *e;
        }
        if (!m->start(std::get<DirtyRateConfig>(config))) {
            return qmp_error("the dirty rate is already being measured.");
        }
        return json::object();
    });
    server.register_command("query-dirty-rate", &kQueryArgs, [m](const json &args) -> QmpResult {
        return dirty_rate_info(m->stat(), args.value("calc-time-unit", "second") ==
                                              std::string("millisecond"));
    });
    return measure;
}

} // namespace qmigd
