// Milliseconds on the monotonic clock, for spans of time a thread measures (not the time of day).
#pragma once

#include <chrono>
#include <cstdint>

namespace qmigd {

// From std::chrono::steady_clock's epoch (a steady_clock::time_point of
// that many milliseconds is the same instant): only differences and
// deadlines mean anything. Any thread.
inline int64_t monotonic_ms()
{
    using namespace std::chrono;
    return duration_cast<milliseconds>(steady_clock::now().time_since_epoch()).count();
}

} // namespace qmigd
