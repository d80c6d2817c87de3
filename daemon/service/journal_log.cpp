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

void log_escape(std::string_view text, spdlog::memory_buf_t &out)
{
    static const char hex[] = "0123456789abcdef";
    for (char c : text) {
        auto u = static_cast<unsigned char>(c);
        if (u >= 0x20 && u != 0x7f) {
            out.push_back(c);
            continue;
        }
        const char *named = u == '\n' ? "\\n" : u == '\t' ? "\\t" : u == '\r' ? "\\r" : nullptr;
        if (named) {
            out.append(named, named + 2);
        } else {
            char esc[4] = {'\\', 'x', hex[u >> 4], hex[u & 15]};
            out.append(esc, esc + 4);
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
