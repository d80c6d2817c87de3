#include "daemon/qemu_file_writer.h"

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
    Status st = buf_.empty() ? Status() : write_full(fd_, buf_.data(), buf_.size());
    if (!st) {
        err_ = Error(st.error()).prepend("main channel: ");
        return *err_;
    }
    written_ += buf_.size();
    buf_.clear();
    return {};
}

} // namespace qmigd
