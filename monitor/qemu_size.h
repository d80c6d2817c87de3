// QEMU's size syntax (util/cutils.c do_strtosz), shared by HMP values
// (qemu_strtosz_MiB) and migration URIs (file:…,offset=, qemu_strtosz).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace qmigd {

// QEMU 10's do_strtosz: leading blanks and a '+'; decimal digits with an
// optional fraction (rounded as QEMU rounds, exactly: 1.9999K is 2048), or
// 0x hex digits with neither fraction nor unit; then an optional unit
// B K M G T P E (any case; none means 2^default_shift; a fraction needs one
// above B) and nothing else. No '-', exponent, inf or nan. On failure *err
// (if given) is EINVAL, or ERANGE when the value does not fit in 64 bits
// (or is negative).
std::optional<uint64_t> qemu_strtosz(const std::string &text, unsigned default_shift,
                                     int *err = nullptr);

} // namespace qmigd
