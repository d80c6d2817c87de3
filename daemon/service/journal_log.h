// Log lines journald files with their priority: when stderr is a journal
// stream ($JOURNAL_STREAM names its device and inode, as systemd sets it
// for a service), each line starts with the syslog priority in angle
// brackets (sd-daemon(3)'s "<3>" prefix) instead of a timestamp, which
// journald adds itself.
#pragma once

namespace qmigd {

// Whether fd 2 is the stream $JOURNAL_STREAM names.
bool stderr_is_journal();
// Sets the default logger's pattern: the journal's, or a timestamped one.
void set_log_pattern(bool journal);

} // namespace qmigd
