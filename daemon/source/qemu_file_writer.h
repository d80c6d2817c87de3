// Buffered writer of the source's main channel (QEMUFile's put side):
// records are encoded into a buffer that leaves in one write when full.
//
// Owned by the migration thread, which alone writes through it; the
// Channel it writes to is the migration thread's too, and outlives it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "protocol/error.h"
#include "protocol/wire.h"

namespace qmigd {

class Channel;

class QEMUFileWriter {
public:
    // Writes go through the channel's TLS session once it has one.
    explicit QEMUFileWriter(Channel &ch) : ch_(&ch), w_(buf_) { buf_.reserve(kFlushAt + 4096); }

    ByteWriter &w() { return w_; }
    // The channel written to (mapped-ram writes pages beside the stream).
    Channel &channel() { return *ch_; }
    // Postcopy recovery: the stream goes on over a new connection; what
    // was queued for the broken one, and its error, are dropped (the
    // destination tells which pages it has). Byte counts go on.
    void reconnect(Channel &ch)
    {
        ch_ = &ch;
        buf_.clear();
        err_.reset();
    }
    // Writes everything queued. Sticky error.
    Status flush();
    // Flushes when enough is queued (call between records).
    Status maybe_flush();
    uint64_t bytes_written() const { return written_; }
    // Bytes queued and written.
    uint64_t bytes_total() const { return written_ + buf_.size(); }

    // A file channel's position (QEMU's qemu_get_offset()): where the next
    // queued byte lands. Flushes first.
    Result<uint64_t> offset();
    // qemu_set_offset(): the stream goes on at `pos` (mapped-ram skips each
    // block's pages region this way). Flushes first.
    Status seek(uint64_t pos);
    // qemu_put_buffer_at(): n bytes at file offset pos, beside the stream.
    Status write_at(const void *data, size_t n, uint64_t pos);

private:
    static constexpr size_t kFlushAt = 512 * 1024;

    Channel *ch_; // borrowed: the migration thread's, replaced by reconnect()
    std::vector<uint8_t> buf_;
    ByteWriter w_;
    uint64_t written_ = 0;
    std::optional<Error> err_;
};

} // namespace qmigd
