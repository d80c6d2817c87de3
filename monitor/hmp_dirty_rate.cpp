// calc_dirty_rate's arguments as QEMU's monitor parses them, and info dirty_rate's text.
#include "monitor/hmp_dirty_rate.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <optional>

#include <fmt/format.h>

namespace qmigd {

namespace {

void skip_spaces(const char *&p)
{
    while (std::isspace(static_cast<unsigned char>(*p))) {
        p++;
    }
}

// The monitor's recursive-descent expression parser (monitor/hmp.c):
// sum of products of bitwise terms of unary terms. Errors end the parse.
// Unlike QEMU's, it bounds its recursion (QEMU's overflows its stack on a
// long line of '~' or '(') and defines the divisions the CPU traps on.
struct ExprParser {
    // As deep as the QMP parser nests (json_splitter.h): a few MiB of stack
    // at most, under ASan too.
    static constexpr int kMaxDepth = 1 << 10;

    const char *p;
    std::optional<std::string> error;
    int depth = 0;

    // next(): past this character and the spaces after it.
    char next()
    {
        char c = *p++;
        skip_spaces(p);
        return c;
    }
    int64_t fail(std::string msg)
    {
        if (!error) {
            error = std::move(msg);
        }
        return 0;
    }
    int64_t unary();
    int64_t unary_at_depth();
    int64_t logic();
    int64_t prod();
    int64_t sum();
};

int64_t ExprParser::unary()
{
    if (error) {
        return 0;
    }
    if (depth == kMaxDepth) {
        return fail("expression nested too deeply");
    }
    depth++;
    int64_t v = unary_at_depth();
    depth--;
    return v;
}

int64_t ExprParser::unary_at_depth()
{
    switch (*p) {
    case '+':
        next();
        return unary();
    case '-':
        next();
        return int64_t(0 - uint64_t(unary()));
    case '~':
        next();
        return ~unary();
    case '(': {
        next();
        int64_t n = sum();
        if (*p != ')') {
            return fail("')' expected");
        }
        next();
        return n;
    }
    case '\0':
        return fail("unexpected end of expression");
    default:
        break;
    }
    errno = 0;
    char *end = nullptr;
    unsigned long long n = std::strtoull(p, &end, 0);
    if (errno == ERANGE) {
        return fail("number too large");
    }
    if (end == p) {
        return fail(fmt::format("invalid char '{}' in expression", *p));
    }
    p = end;
    skip_spaces(p);
    return int64_t(n);
}

int64_t ExprParser::logic()
{
    int64_t v = unary();
    while (!error && (*p == '&' || *p == '|' || *p == '^')) {
        char op = next();
        int64_t w = unary();
        v = op == '&' ? v & w : op == '|' ? v | w : v ^ w;
    }
    return v;
}

int64_t ExprParser::prod()
{
    int64_t v = logic();
    while (!error && (*p == '*' || *p == '/' || *p == '%')) {
        char op = next();
        int64_t w = logic();
        if (op == '*') {
            v = int64_t(uint64_t(v) * uint64_t(w));
        } else if (w == 0) {
            return fail("division by zero");
        } else if (w == -1) { // INT64_MIN / -1 traps: the wrapped quotient, remainder 0
            v = op == '/' ? int64_t(0 - uint64_t(v)) : 0;
        } else {
            v = op == '/' ? v / w : v % w;
        }
    }
    return v;
}

int64_t ExprParser::sum()
{
    int64_t v = prod();
    while (!error && (*p == '+' || *p == '-')) {
        char op = next();
        int64_t w = prod();
        v = int64_t(op == '+' ? uint64_t(v) + uint64_t(w) : uint64_t(v) - uint64_t(w));
    }
    return v;
}

std::string try_help(const std::string &topic)
{
    return "Try \"help " + topic + "\" for more information\r\n";
}

} // namespace

std::optional<std::string> hmp_parse_expr(const char *&p, int64_t *value)
{
    ExprParser e{p, std::nullopt};
    *value = e.sum();
    if (e.error) {
        return e.error;
    }
    p = e.p;
    return std::nullopt;
}

std::string hmp_format_info_dirty_rate(const json &info)
{
    std::string mode = info.value("mode", "");
    std::string s = fmt::format("Status: {}\r\n", info.value("status", ""));
    // QEMU labels Unix seconds "(ms)".
    s += fmt::format("Start Time: {} (ms)\r\n", info.value("start-time", int64_t(0)));
    if (mode == "page-sampling") {
        s += fmt::format("Sample Pages: {} (per GB)\r\n", info.value("sample-pages", uint64_t(0)));
    }
    s += fmt::format("Period: {} (sec)\r\n", info.value("calc-time", int64_t(0)));
    s += fmt::format("Mode: {}\r\n", mode);
    if (info.contains("dirty-rate")) {
        s += fmt::format("Dirty rate: {} (MB/s)\r\n", info["dirty-rate"].get<int64_t>());
    } else {
        s += "Dirty rate: (not ready)\r\n";
    }
    return s;
}

std::string hmp_calc_dirty_rate(QmpServer &server, bool dirty_ring, bool dirty_bitmap,
                                const std::string &rest, const std::string &topic)
{
    const char *p = rest.c_str();
    skip_spaces(p);
    int64_t sec = 0, sample_pages = -1;
    if (auto e = hmp_parse_expr(p, &sec)) {
        return *e + "\r\n" + try_help(topic);
    }
    skip_spaces(p);
    if (*p) { // the optional sample_pages_per_GB
        if (auto e = hmp_parse_expr(p, &sample_pages)) {
            return *e + "\r\n" + try_help(topic);
        }
        skip_spaces(p);
    }
    if (*p) {
        return topic + ": extraneous characters at the end of line\r\n" + try_help(topic);
    }
    if (sec == 0) {
        return "Incorrect period length specified!\r\n";
    }
    if (dirty_ring && dirty_bitmap) {
        return "Either dirty ring or dirty bitmap can be specified!\r\n";
    }
    json args = {{"calc-time", sec},
                 {"mode", dirty_bitmap ? "dirty-bitmap" : dirty_ring ? "dirty-ring" : "page-sampling"}};
    if (sample_pages != -1) {
        args["sample-pages"] = sample_pages;
    }
    QmpResult r = server.dispatch("calc-dirty-rate", args);
    if (auto *e = std::get_if<QmpError>(&r)) {
        return "Error: " + e->desc + "\r\n";
    }
    return fmt::format("Starting dirty rate measurement with period {} seconds\r\n"
                       "[Please use 'info dirty_rate' to check results]\r\n",
                       sec);
}

} // namespace qmigd
