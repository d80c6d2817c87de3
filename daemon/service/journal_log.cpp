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

} // namespace

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
    if (!journal) {
        spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e qmigd %l: %v");
        return;
    }
    auto f = std::make_unique<spdlog::pattern_formatter>();
    f->add_flag<SyslogPriority>('*').set_pattern("%*%l: %v");
    spdlog::set_formatter(std::move(f));
}

} // namespace qmigd
