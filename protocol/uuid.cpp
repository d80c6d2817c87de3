// UUIDs in QEMU's text form: parsing and printing.
#include <cstdio>

#include "protocol/qemu_format.h"

namespace qmigd {

std::string uuid_to_string(const Uuid &u)
{
    char s[37];
    std::snprintf(s, sizeof(s),
                  "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                  u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
                  u[12], u[13], u[14], u[15]);
    return s;
}

bool uuid_parse(const std::string &text, Uuid *out)
{
    if (text.size() != 36) {
        return false;
    }
    size_t j = 0;
    for (size_t i = 0; i < 36;) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (text[i] != '-') {
                return false;
            }
            i++;
            continue;
        }
        unsigned v;
        if (std::sscanf(text.c_str() + i, "%2x", &v) != 1 || !isxdigit(text[i]) ||
            !isxdigit(text[i + 1])) {
            return false;
        }
        (*out)[j++] = uint8_t(v);
        i += 2;
    }
    return true;
}

} // namespace qmigd
