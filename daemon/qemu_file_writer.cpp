#include "daemon/qemu_file_writer.h"

#include "daemon/socket_io.h"

namespace qmigd {

void QEMUFileWriter::close_buffer_segment()
{
    if (buf_.size() > seg_start_) {
        segs_.push_back({nullptr, seg_start_, buf_.size() - seg_start_});
        seg_start_ = buf_.size();
    }
}

void QEMUFileWriter::add_page(const uint8_t *page, size_t len)
{
    close_buffer_segment();
    segs_.push_back({page, 0, len});
    page_bytes_ += len;
}

size_t QEMUFileWriter::pending_bytes() const { return buf_.size() + page_bytes_; }

Status QEMUFileWriter::maybe_flush()
{
    if (pending_bytes() >= kFlushAt || segs_.size() >= kMaxIov) {
        return flush();
    }
    return err_ ? Status(*err_) : Status();
}

Status QEMUFileWriter::flush()
{
    if (err_) {
        return *err_;
    }
    close_buffer_segment();
    std::vector<struct iovec> iov;
    iov.reserve(segs_.size());
    for (const auto &s : segs_) {
        const uint8_t *p = s.ptr ? s.ptr : buf_.data() + s.off;
        iov.push_back({const_cast<uint8_t *>(p), s.len});
    }
    size_t total = pending_bytes();
    Status st = iov.empty() ? Status() : writev_full(fd_, iov.data(), int(iov.size()));
    if (!st) {
        err_ = st.error();
        return st;
    }
    written_ += total;
    buf_.clear();
    segs_.clear();
    seg_start_ = 0;
    page_bytes_ = 0;
    return {};
}

} // namespace qmigd
