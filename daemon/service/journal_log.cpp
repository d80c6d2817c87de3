// Log lines journald files with their priority (sd-daemon's "<N>" prefixes) when stderr is its stream.
#include "daemon/service/journal_log.h"

#include <cstdio>
#include <cstdlib>
#include <sys/stat.h>

#include <spdlog/pattern_formatter.h>
#include <spdlog/spdlog.h>

namespace qmigd {

namespace {

// %* : "<N>", the syslog priority of the message's level.
class SyslogPriority : public spdlog::custom_flag_formatter {
public:
    void format(const spdlog::details::log_msg &msg, const std::tm &,
                spdlog::memory_buf_t &dest) override
    {
        int prio = 6; // info
        switch (msg.level) {
        case spdlog::level::trace:
        case spdlog::level::debug: prio = 7; break;
        case spdlog::level::warn: prio = 4; break;
        case spdlog::level::err: prio = 3; break;
        case spdlog::level::critical: prio = 2; break;
        default: break;
        }
        char text[4] = {'<', char('0' + prio), '>', '\0'};
        dest.append(text, text + 3);
    }
    std::unique_ptr<custom_flag_formatter> clone() const override
    {
        return std::make_unique<SyslogPriority>();
    }
};

// %& : the message with its control characters escaped. A line's text
// comes from peers, monitor clients and file names; a newline in it would
// start a line of the sender's choice, "<0>" a journal priority, an ESC a
// terminal's control sequence. Escaped here, once, whatever logged it.
class EscapedPayload : public spdlog::custom_flag_formatter {
public:
    void format(const spdlog::details::log_msg &msg, const std::tm &,
                spdlog::memory_buf_t &dest) override
    {
        log_escape(std::string_view(msg.payload.data(), msg.payload.size()), dest);
    }
    std::unique_ptr<custom_flag_formatter> clone() const override
    {
        return std::make_unique<EscapedPayload>();
    }
};

} // namespace

namespace {

// Length of the well-formed UTF-8 sequence at text[i] (RFC 3629: no
// overlongs, no surrogates, at most U+10FFFF), or 0 if it is not one.
size_t utf8_length(std::string_view text, size_t i)
{
    auto at = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
    unsigned char b = at(i);
    size_t n = b >= 0xc2 && b <= 0xdf ? 2 : b >= 0xe0 && b <= 0xef ? 3 : b >= 0xf0 && b <= 0xf4 ? 4 : 0;
    if (n == 0 || i + n > text.size()) {
        return 0;
    }
    for (size_t k = 1; k < n; k++) {
        if ((at(i + k) & 0xc0) != 0x80) {
            return 0;
        }
    }
    unsigned char c = at(i + 1);
    bool bad = (b == 0xe0 && c < 0xa0) || (b == 0xed && c >= 0xa0) || (b == 0xf0 && c < 0x90) ||
               (b == 0xf4 && c >= 0x90);
    return bad ? 0 : n;
}

void append_hex(unsigned char u, spdlog::memory_buf_t &out)
{
    static const char hex[] = "0123456789abcdef";
    char esc[4] = {'\\', 'x', hex[u >> 4], hex[u & 15]};
    out.append(esc, esc + 4);
}

} // namespace

// Escapes what a terminal or the journal would act on: C0 controls, DEL, the
// C1 controls U+0080..U+009F (CSI U+009B, NEL U+0085), the line and paragraph
// separators U+2028/U+2029, and bytes that are not well-formed UTF-8.
void log_escape(std::string_view text, spdlog::memory_buf_t &out)
{
    for (size_t i = 0; i < text.size();) {
        auto u = static_cast<unsigned char>(text[i]);
        if (u >= 0x20 && u < 0x7f) {
            out.push_back(text[i++]);
            continue;
        }
        const char *named = u == '\n' ? "\\n" : u == '\t' ? "\\t" : u == '\r' ? "\\r" : nullptr;
        if (named) {
            out.append(named, named + 2);
            i++;
            continue;
        }
        size_t n = u < 0x80 ? 0 : utf8_length(text, i);
        std::string_view seq = text.substr(i, n);
        if (n == 0) {
            append_hex(u, out);
            i++;
        } else if (seq == "\xe2\x80\xa8" || seq == "\xe2\x80\xa9") {
            out.append(std::string_view(seq == "\xe2\x80\xa8" ? "\\u2028" : "\\u2029"));
            i += n;
        } else if (u == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0) {
            append_hex(u, out); // a C1 control
            append_hex(static_cast<unsigned char>(text[i + 1]), out);
            i += n;
        } else {
            out.append(seq);
            i += n;
        }
    }
}

bool stderr_is_journal()
{
    const char *env = std::getenv("JOURNAL_STREAM");
    unsigned long long dev = 0, ino = 0;
    struct stat st;
    if (!env || std::sscanf(env, "%llu:%llu", &dev, &ino) != 2 || fstat(2, &st) != 0) {
        return false;
    }
    return st.st_dev == dev && st.st_ino == ino;
}

void set_log_pattern(bool journal)
{
    auto f = std::make_unique<spdlog::pattern_formatter>();
    f->add_flag<EscapedPayload>('&');
    if (journal) {
        f->add_flag<SyslogPriority>('*').set_pattern("%*%l: %&");
    } else {
        f->set_pattern("%Y-%m-%d %H:%M:%S.%e qmigd %l: %&");
    }
    spdlog::set_formatter(std::move(f));
}

} // namespace qmigd
