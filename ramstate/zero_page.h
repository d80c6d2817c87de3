// Zero-page detection (QEMU's buffer_is_zero for one target page).
#pragma once

#include <cstdint>
#include <string_view>

namespace qmigd {

// QEMU's zero-page-detection parameter: where a source looks for zero
// pages -- nowhere, on the migration thread (ZERO records on the main
// channel), or in the multifd sender threads (listed in the packets).
enum class ZeroPageDetection { None, Legacy, Multifd };

inline const char *zero_page_detection_name(ZeroPageDetection z)
{
    return z == ZeroPageDetection::None ? "none" : z == ZeroPageDetection::Legacy ? "legacy" : "multifd";
}

// The parameter's QAPI value ("none", "legacy", "multifd"); the monitor
// has checked it.
inline ZeroPageDetection zero_page_detection_parse(std::string_view v)
{
    return v == "none" ? ZeroPageDetection::None
           : v == "legacy" ? ZeroPageDetection::Legacy
                           : ZeroPageDetection::Multifd;
}

// True if all 4096 bytes are zero. SIMD (AVX2 where the CPU has it, SSE2
// otherwise); returns early at the first non-zero 128 bytes.
bool buffer_is_zero_page(const uint8_t *page);

} // namespace qmigd
