// XBZRLE: a page's delta against its previous copy, encoded and applied with bounds checks.
#include "protocol/xbzrle.h"

#include <cstring>

namespace qmigd {

namespace {

// ULEB128 of at most 14 bits: one byte below 0x80, else two.
size_t put_length(uint8_t *out, uint32_t n)
{
    if (n < 0x80) {
        out[0] = uint8_t(n);
        return 1;
    }
    out[0] = uint8_t((n & 0x7f) | 0x80);
    out[1] = uint8_t(n >> 7);
    return 2;
}

// The caller guarantees two readable bytes. 0 when the value is wider
// than 14 bits.
size_t get_length(const uint8_t *in, uint32_t *n)
{
    if (!(in[0] & 0x80)) {
        *n = in[0];
        return 1;
    }
    if (in[1] & 0x80) {
        return 0;
    }
    *n = uint32_t(in[0] & 0x7f) | uint32_t(in[1]) << 7;
    return 2;
}

uint64_t load64(const uint8_t *p)
{
    uint64_t v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

// Bytes from i on that are equal in both pages, a word at a time.
size_t equal_run(const uint8_t *a, const uint8_t *b, size_t i, size_t len)
{
    size_t start = i;
    while (i + 8 <= len && load64(a + i) == load64(b + i)) {
        i += 8;
    }
    while (i < len && a[i] == b[i]) {
        i++;
    }
    return i - start;
}

// Bytes from i on that differ, up to the first equal byte. A word whose
// XOR has a zero byte holds the run's end; words with none are skipped
// whole (the same has-zero-byte test QEMU uses).
size_t changed_run(const uint8_t *a, const uint8_t *b, size_t i, size_t len)
{
    constexpr uint64_t kOnes = 0x0101010101010101ULL;
    size_t start = i;
    while (i + 8 <= len) {
        uint64_t x = load64(a + i) ^ load64(b + i);
        if ((x - kOnes) & ~x & (kOnes << 7)) {
            break;
        }
        i += 8;
    }
    while (i < len && a[i] != b[i]) {
        i++;
    }
    return i - start;
}

} // namespace

int xbzrle_encode(const uint8_t *old_page, const uint8_t *new_page, size_t len, uint8_t *dst,
                  size_t dlen)
{
    size_t d = 0, i = 0;
    while (i < len) {
        if (d + 2 > dlen) {
            return -1;
        }
        size_t zrun = equal_run(old_page, new_page, i, len);
        if (zrun == len) {
            return 0; // unchanged
        }
        i += zrun;
        if (i == len) {
            return int(d); // the trailing zero run is left out
        }
        d += put_length(dst + d, uint32_t(zrun));
        if (d + 2 > dlen) {
            return -1;
        }
        size_t nzrun = changed_run(old_page, new_page, i, len);
        d += put_length(dst + d, uint32_t(nzrun));
        if (d + nzrun > dlen) {
            return -1;
        }
        std::memcpy(dst + d, new_page + i, nzrun);
        d += nzrun;
        i += nzrun;
    }
    return int(d);
}

int xbzrle_decode(const uint8_t *src, size_t slen, uint8_t *page, size_t dlen)
{
    size_t i = 0, d = 0;
    while (i < slen) {
        uint32_t count = 0;
        if (slen - i < 2) {
            return -1;
        }
        size_t n = get_length(src + i, &count);
        // Only the first zero run may be empty (QEMU's rule).
        if (n == 0 || (i && !count)) {
            return -1;
        }
        i += n;
        d += count;
        if (d > dlen || slen - i < 2) {
            return -1;
        }
        n = get_length(src + i, &count);
        if (n == 0 || !count) {
            return -1;
        }
        i += n;
        if (count > dlen - d || count > slen - i) {
            return -1;
        }
        std::memcpy(page + d, src + i, count);
        d += count;
        i += count;
    }
    return int(d);
}

} // namespace qmigd
