// QEMUFileWriter: the main channel's buffered writes, and a file channel's offsets.
#include "daemon/source/qemu_file_writer.h"

#include <cerrno>
#include <cstring>
#include <unistd.h>

#include <fmt/format.h>

#include "daemon/channel.h"
#include "daemon/socket_io.h"

namespace qmigd {

Status QEMUFileWriter::maybe_flush()
{
    if (buf_.size() >= kFlushAt) {
        return flush();
    }
    return err_ ? Status(*err_) : Status();
}

Status QEMUFileWriter::flush()
{
    if (err_) {
        return *err_;
    }
    Status st = buf_.empty() ? Status() : ch_->write(buf_.data(), buf_.size());
    if (!st) {
        err_ = Error(st.error()).prepend("main channel: ");
        return *err_;
    }
    written_ += buf_.size();
    buf_.clear();
    return {};
}

Result<uint64_t> QEMUFileWriter::offset()
{
    QMIGD_TRY(flush());
    off_t pos = ::lseek(ch_->fd(), 0, SEEK_CUR);
    if (pos < 0) {
        return Error(fmt::format("main channel: cannot tell the file offset: {}",
                                 std::strerror(errno)));
    }
    return uint64_t(pos);
}

Status QEMUFileWriter::seek(uint64_t pos)
{
    QMIGD_TRY(flush());
    if (::lseek(ch_->fd(), off_t(pos), SEEK_SET) < 0) {
        err_ = Error(fmt::format("Unable to seek to offset {} whence {} in file: {}", pos,
                                 SEEK_SET, std::strerror(errno)));
        return *err_;
    }
    return {};
}

Status QEMUFileWriter::write_at(const void *data, size_t n, uint64_t pos)
{
    if (err_) {
        return *err_;
    }
    Status st = pwrite_full(ch_->fd(), data, n, pos);
    if (!st) {
        err_ = Error(st.error()).prepend("main channel: ");
        return *err_;
    }
    return {}; // not stream bytes: the caller counts them
}

} // namespace qmigd
