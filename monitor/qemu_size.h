// QEMU's size syntax (util/cutils.c do_strtosz), shared by HMP values
// (qemu_strtosz_MiB) and migration URIs (file:…,offset=, qemu_strtosz).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace qmigd {

// Decimal digits with an optional fraction, or 0x hex digits; then an
// optional unit B K M G T P E (any case; none means 2^default_shift) and
// nothing else. No sign, exponent, inf or nan. On failure *err (if given)
// is EINVAL, or ERANGE when the value does not fit in 64 bits.
std::optional<uint64_t> qemu_strtosz(const std::string &text, unsigned default_shift,
                                     int *err = nullptr);

} // namespace qmigd
