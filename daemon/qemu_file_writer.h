// Buffered writer of the source's main channel (QEMUFile's put side):
// records are encoded into a buffer, page data is referenced in place
// (an iovec into the mapped image) and everything leaves in one writev.
//
// Owned by the migration thread.
#pragma once

#include <cstdint>
#include <optional>
#include <sys/uio.h>
#include <vector>

#include "protocol/error.h"
#include "protocol/wire.h"

namespace qmigd {

class QEMUFileWriter {
public:
    explicit QEMUFileWriter(int fd) : fd_(fd), w_(buf_) { buf_.reserve(kFlushAt + 4096); }

    ByteWriter &w() { return w_; }
    // Appends a page by reference; it must stay mapped until flush().
    void add_page(const uint8_t *page, size_t len);
    // Writes everything queued. Sticky error.
    Status flush();
    // Flushes when enough is queued (call between records).
    Status maybe_flush();
    uint64_t bytes_written() const { return written_; }
    // Bytes queued and written.
    uint64_t bytes_total() const { return written_ + pending_bytes(); }

private:
    static constexpr size_t kFlushAt = 512 * 1024;
    static constexpr size_t kMaxIov = 512;

    struct Segment {
        const uint8_t *ptr; // nullptr: [off, off+len) of buf_
        size_t off;
        size_t len;
    };
    size_t pending_bytes() const;
    void close_buffer_segment();

    int fd_;
    std::vector<uint8_t> buf_;
    ByteWriter w_;
    std::vector<Segment> segs_;
    size_t seg_start_ = 0;   // start of buf_ bytes not yet in segs_
    size_t page_bytes_ = 0;  // queued bytes referenced in place
    uint64_t written_ = 0;
    std::optional<Error> err_;
};

} // namespace qmigd
