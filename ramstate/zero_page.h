// Zero-page detection (QEMU's buffer_is_zero for one target page).
#pragma once

#include <cstdint>

namespace qmigd {

// True if all 4096 bytes are zero. SIMD (AVX2 where the CPU has it, SSE2
// otherwise); returns early at the first non-zero 128 bytes.
bool buffer_is_zero_page(const uint8_t *page);

} // namespace qmigd
