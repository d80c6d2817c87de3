// libFuzzer target: arbitrary HMP command lines through
// human-monitor-command (the HMP parser, size and integer conversions, and
// the QMP commands they reach). The answer is always a string.
#include <cstdint>
#include <string>

#include "fake_engine.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static FakeEngine engine;
    std::string line(reinterpret_cast<const char *>(data), size);
    if (!json(line).dump(-1, ' ', false, json::error_handler_t::replace).empty()) {
        // As a QMP client would send it: valid UTF-8 only reaches HMP.
        json s = json::parse(json(line).dump(-1, ' ', false, json::error_handler_t::replace));
        QmpResult r = engine.server.dispatch("human-monitor-command",
                                             json{{"command-line", s}});
        if (!std::holds_alternative<json>(r) || !std::get<json>(r).is_string()) {
            __builtin_trap();
        }
    }
    return 0;
}
