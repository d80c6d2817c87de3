// qemu_strtosz: QEMU 10's size syntax (util/cutils.c do_strtosz), step for
// step, so that every string means here what it means to QEMU: the table in
// tests/data/qemu-sizes.json comes from QEMU 10 itself.
#include "monitor/qemu_size.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace qmigd {

namespace {

// A unit letter's multiplier (any case), or 0 if c is none.
uint64_t suffix_mul(char c)
{
    static const char units[] = "BKMGTPE";
    const char *u = c ? std::strchr(units, std::toupper(static_cast<unsigned char>(c))) : nullptr;
    return u ? uint64_t(1) << (10 * (u - units)) : 0;
}

// The fraction after the integral part (or the whole text when that had no
// digits): strtod's reading with any exponent cut off, since 'e' is the
// exa unit here. *end moves past what it read. A 64.64 fixed-point
// fraction in *valf, or a carry into *val when it rounds to 1.0.
int read_fraction(const char *&end, uint64_t *val, uint64_t *valf)
{
    std::string copy(end, std::strcspn(end, "eE"));
    errno = 0;
    char *tail = nullptr;
    double fraction = std::strtod(copy.c_str(), &tail);
    int rc = tail == copy.c_str() ? -EINVAL : -errno;
    if (!std::isfinite(fraction)) {
        return -EINVAL;
    }
    end += tail - copy.c_str();
    if (std::signbit(fraction)) {
        return -ERANGE;
    }
    if (fraction == 1.0) {
        if (*val == UINT64_MAX) {
            return -ERANGE;
        }
        ++*val;
    } else if (rc == -ERANGE) { // underflow: a fraction too small for a double, still not 0
        *valf = 1;
        rc = 0;
    } else {
        *valf = uint64_t(std::ldexp(fraction, 64));
        if (*valf == 0 && fraction > 0.0) {
            *valf = 1;
        }
    }
    return rc;
}

// do_strtosz with `end` where QEMU leaves its endptr, also on errors: an
// error with text after `end` is EINVAL, whatever it was (QEMU's "out:").
int strtosz(const char *text, unsigned default_shift, uint64_t *out, const char *&end)
{
    // The integral part in decimal, as parse_uint: blanks and a sign, and
    // no negative number.
    errno = 0;
    char *endp = nullptr;
    uint64_t val = std::strtoull(text, &endp, 10);
    end = endp;
    int rc = errno ? -errno : end == text ? -EINVAL : 0;
    const char *s = text;
    while (std::isspace(static_cast<unsigned char>(*s))) {
        s++;
    }
    if (rc == 0 && *s == '-') {
        return -ERANGE;
    }
    if (rc == -ERANGE) {
        return rc;
    }
    uint64_t valf = 0;
    if (rc == 0 && val == 0 && (*end == 'x' || *end == 'X')) {
        // Hex: read again in base 16, and no fraction nor unit after it.
        errno = 0;
        val = std::strtoull(text, &endp, 16);
        end = endp;
        if (errno) {
            return -errno;
        }
        if (*end == '.' || suffix_mul(*end)) {
            end = text;
            return -EINVAL;
        }
    } else if (*end == '.' || (end == text && std::strchr(text, '.'))) {
        if (rc == 0 && *end == '.' && !std::isdigit(static_cast<unsigned char>(end[1]))) {
            end++; // "1." and "1.k": no fractional digits
        } else {
            rc = read_fraction(end, &val, &valf);
        }
    }
    if (rc) {
        return rc;
    }
    uint64_t mul = suffix_mul(*end);
    if (mul) {
        end++;
    } else {
        mul = uint64_t(1) << default_shift;
    }
    if (mul == 1) {
        if (valf != 0) { // a fraction needs a unit
            end = text;
            return -EINVAL;
        }
        *out = val;
        return 0;
    }
    // Exactly, as QEMU: 64.64 fixed point times the unit, 0.5 rounded up.
    unsigned __int128 whole = (unsigned __int128)val * mul;
    unsigned __int128 part = (unsigned __int128)valf * mul;
    whole += part >> 64;
    whole += uint64_t(part) >> 63;
    if (whole >> 64) {
        return -ERANGE;
    }
    *out = uint64_t(whole);
    return 0;
}

} // namespace

std::optional<uint64_t> qemu_strtosz(const std::string &text, unsigned default_shift, int *err)
{
    int ignored;
    int &e = err ? *err : ignored;
    uint64_t v = 0;
    const char *end = text.c_str();
    int rc = strtosz(text.c_str(), default_shift, &v, end);
    // Text after what was read, a NUL inside included (QEMU's C string
    // would end there: refused instead), is EINVAL.
    if (*end || text.find('\0') != std::string::npos) {
        rc = -EINVAL;
    }
    e = -rc;
    if (rc) {
        return std::nullopt;
    }
    return v;
}

} // namespace qmigd
