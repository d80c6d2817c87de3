// Log lines journald files with their priority: when stderr is a journal
// stream ($JOURNAL_STREAM names its device and inode, as systemd sets it
// for a service), each line starts with the syslog priority in angle
// brackets (sd-daemon(3)'s "<3>" prefix) instead of a timestamp, which
// journald adds itself.
//
// Either way a line is one line: control characters in a message (a
// peer's block name, a monitor client's URI, a file name) are escaped by
// the formatter, so no caller can start a line or forge a priority.
#pragma once

#include <string_view>

#include <spdlog/common.h>

namespace qmigd {

// Appends text with C0 controls and DEL escaped: \n \t \r, else \xNN.
void log_escape(std::string_view text, spdlog::memory_buf_t &out);

// Whether fd 2 is the stream $JOURNAL_STREAM names.
bool stderr_is_journal();
// Sets the default logger's formatter (every sink): the journal's
// pattern, or a timestamped one; the message escaped in both.
void set_log_pattern(bool journal);

} // namespace qmigd
