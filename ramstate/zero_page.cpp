// Zero-page detection: AVX2 and SSE2 scans chosen at run time.
#include "ramstate/zero_page.h"

#include <cstring>
#include <immintrin.h>

#include "protocol/qemu_format.h"

namespace qmigd {

namespace {

bool is_zero_sse2(const uint8_t *p)
{
    const __m128i *v = reinterpret_cast<const __m128i *>(p);
    const __m128i zero = _mm_setzero_si128();
    for (size_t i = 0; i < TARGET_PAGE_SIZE / 16; i += 8) {
        __m128i t = _mm_or_si128(_mm_or_si128(_mm_loadu_si128(v + i), _mm_loadu_si128(v + i + 1)),
                                 _mm_or_si128(_mm_loadu_si128(v + i + 2), _mm_loadu_si128(v + i + 3)));
        __m128i u = _mm_or_si128(_mm_or_si128(_mm_loadu_si128(v + i + 4), _mm_loadu_si128(v + i + 5)),
                                 _mm_or_si128(_mm_loadu_si128(v + i + 6), _mm_loadu_si128(v + i + 7)));
        if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_or_si128(t, u), zero)) != 0xffff) {
            return false;
        }
    }
    return true;
}

__attribute__((target("avx2"))) bool is_zero_avx2(const uint8_t *p)
{
    const __m256i *v = reinterpret_cast<const __m256i *>(p);
    for (size_t i = 0; i < TARGET_PAGE_SIZE / 32; i += 4) {
        __m256i t = _mm256_or_si256(_mm256_or_si256(_mm256_loadu_si256(v + i), _mm256_loadu_si256(v + i + 1)),
                                    _mm256_or_si256(_mm256_loadu_si256(v + i + 2), _mm256_loadu_si256(v + i + 3)));
        if (!_mm256_testz_si256(t, t)) {
            return false;
        }
    }
    return true;
}

using ZeroCheck = bool (*)(const uint8_t *);

ZeroCheck select_zero_check()
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? is_zero_avx2 : is_zero_sse2;
}

const ZeroCheck zero_check = select_zero_check();

} // namespace

bool buffer_is_zero_page(const uint8_t *page)
{
    // Most non-zero pages have data in their first word: skip the vector
    // setup for them.
    uint64_t head;
    std::memcpy(&head, page, sizeof(head));
    return head == 0 && zero_check(page);
}

} // namespace qmigd
