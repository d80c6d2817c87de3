// qemu_strtosz: QEMU's size syntax (suffixes, fractions, hex) with its limits.
#include "monitor/qemu_size.h"

#include <cctype>
#include <cerrno>

namespace qmigd {

std::optional<uint64_t> qemu_strtosz(const std::string &text, unsigned default_shift, int *err)
{
    int ignored;
    int &e = err ? *err : ignored;
    e = EINVAL;
    size_t i = 0;
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) {
        i++;
    }
    bool hex = text.compare(i, 2, "0x") == 0 || text.compare(i, 2, "0X") == 0;
    i += hex ? 2 : 0;
    uint64_t whole = 0;
    size_t digits = 0;
    for (; i < text.size() && std::isxdigit(static_cast<unsigned char>(text[i])); i++, digits++) {
        int d = std::isdigit(static_cast<unsigned char>(text[i])) ? text[i] - '0'
                                                                  : (std::tolower(text[i]) - 'a' + 10);
        if (!hex && d > 9) {
            break;
        }
        unsigned base = hex ? 16 : 10;
        if (whole > (UINT64_MAX - unsigned(d)) / base) {
            e = ERANGE;
            return std::nullopt;
        }
        whole = whole * base + unsigned(d);
    }
    if (digits == 0) {
        return std::nullopt;
    }
    double fraction = 0;
    if (!hex && i < text.size() && text[i] == '.') {
        double scale = 0.1;
        for (i++; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); i++) {
            fraction += (text[i] - '0') * scale;
            scale /= 10;
        }
    }
    static const std::string units = "bkmgtpe";
    unsigned shift = default_shift;
    if (i < text.size()) {
        size_t u = units.find(char(std::tolower(static_cast<unsigned char>(text[i]))));
        if (u == std::string::npos || i + 1 != text.size()) {
            return std::nullopt;
        }
        shift = unsigned(u) * 10;
    }
    uint64_t mul = uint64_t(1) << shift;
    if (mul == 1 && fraction != 0) {
        return std::nullopt;
    }
    uint64_t frac = uint64_t(fraction * double(mul));
    if (whole > (UINT64_MAX - frac) / mul) {
        e = ERANGE;
        return std::nullopt;
    }
    e = 0;
    return whole * mul + frac;
}

} // namespace qmigd
