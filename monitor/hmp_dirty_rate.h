// HMP's calc_dirty_rate and info dirty_rate (QEMU 10's hmp_calc_dirty_rate
// and hmp_info_dirty_rate), run through calc-dirty-rate / query-dirty-rate.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "monitor/qmp_server.h"

namespace qmigd {

// `info dirty_rate` text from a query-dirty-rate result.
std::string hmp_format_info_dirty_rate(const json &info);

// calc_dirty_rate after its flags (-r, -b): `rest` is the line's remaining
// text, "second [sample_pages_per_GB]", read as QEMU's monitor reads 'l'
// arguments (expressions). `topic` names the command for "Try help".
std::string hmp_calc_dirty_rate(QmpServer &server, bool dirty_ring, bool dirty_bitmap,
                                const std::string &rest, const std::string &topic);

// QEMU's monitor expression (get_expr: + - * / % & | ^ ~, parentheses,
// numbers in C's bases) at `p`, leaving `p` after it and its spaces; the
// error text if it is not one.
std::optional<std::string> hmp_parse_expr(const char *&p, int64_t *value);

} // namespace qmigd
