// libFuzzer target: HMP's expression parser (calc_dirty_rate's arguments,
// parsed before the command is looked up) on any bytes. It either fails
// with a message or reads a prefix of its input; it never traps on a
// division nor recurses without bound.
#include <cstdint>
#include <cstring>
#include <string>

#include "monitor/hmp_dirty_rate.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    std::string text(reinterpret_cast<const char *>(data), size); // NUL-terminated
    const char *p = text.c_str();
    int64_t value = 0;
    auto error = hmp_parse_expr(p, &value);
    if (error ? error->empty() || p != text.c_str()
              : p <= text.c_str() || p > text.c_str() + std::strlen(text.c_str())) {
        __builtin_trap();
    }
    return 0;
}
