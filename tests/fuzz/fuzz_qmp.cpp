// libFuzzer target: arbitrary bytes from a QMP client, before and after
// negotiation, through the whole input path (splitter, parser, request
// checks, dispatch, the parameter and capability checks, HMP). Every reply
// must be a JSON object that serialises as valid UTF-8.
#include <cstdint>
#include <string>

#include "fake_engine.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static FakeEngine engine;
    // A broken peer's bytes in error-desc, as a failed migration leaves them.
    engine.error_desc.assign(reinterpret_cast<const char *>(data), size < 16 ? size : 16);
    engine.status = size % 3 ? "failed" : "none";
    for (int negotiated = 0; negotiated < 2; negotiated++) {
        QmpSession s(engine.server);
        if (negotiated) {
            std::string caps = "{\"execute\":\"qmp_capabilities\"}\n";
            s.feed(caps.data(), caps.size());
        }
        // In two pieces: requests split across reads must work the same.
        size_t half = size / 2;
        for (auto [p, n] : {std::pair{data, half}, std::pair{data + half, size - half}}) {
            for (const json &reply : s.feed(reinterpret_cast<const char *>(p), n)) {
                if (!reply.is_object()) {
                    __builtin_trap();
                }
                std::string text = reply.dump(-1, ' ', false, json::error_handler_t::replace);
                if (!json::accept(text)) {
                    __builtin_trap();
                }
            }
        }
    }
    return 0;
}
