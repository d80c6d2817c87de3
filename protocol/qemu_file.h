// Buffered reading of a migration stream, after QEMU's QEMUFile.
//
// Errors are sticky, as in QEMUFile: after the first failure every get_*
// returns 0 and error() says what went wrong, so a decoder can read a whole
// record and check once. A decoder must check before it acts on a value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

#include "protocol/error.h"

namespace qmigd {

// Where the bytes come from: a socket in the daemon, memory in tests.
class InputStream {
public:
    virtual ~InputStream() = default;
    // Reads up to n bytes into dst. Returns the count (>0), 0 at end of
    // stream, or -1 with *err set.
    virtual ssize_t read_some(void *dst, size_t n, std::string *err) = 0;
    // Goes on reading at absolute position pos (a file: mapped-ram skips
    // each block's pages). Streams that cannot seek say so.
    virtual bool seek(uint64_t pos, std::string *err)
    {
        (void)pos;
        *err = "the migration stream is not seekable";
        return false;
    }
};

class QEMUFileReader {
public:
    explicit QEMUFileReader(InputStream &in, size_t buffer_size = 64 * 1024);

    uint8_t get_byte();
    uint16_t get_be16();
    uint32_t get_be32();
    uint64_t get_be64();
    // Reads exactly n bytes into dst; bytes beyond the buffer go straight
    // from the stream into dst (pages land in guest RAM without a copy).
    void get_buffer(void *dst, size_t n);
    // u8 length + bytes.
    std::string get_cstr8();
    void skip(size_t n);
    // qemu_set_offset(): drops what is buffered and reads from pos on.
    void seek(uint64_t pos);
    // Next byte without consuming it; -1 at a clean end of stream or error.
    int peek_byte();
    // Everything left until the end of the stream, appended to out; fails
    // once more than max bytes are left (a parked VM's device state).
    // With `whole`, asked after each read what out holds: reading stops
    // once it says the bytes so far are whole (a peer that waits for our
    // answer before it ends the stream).
    void read_to_end(std::vector<uint8_t> &out, size_t max,
                     const std::function<bool(std::span<const uint8_t>)> &whole = {});

    bool failed() const { return err_.has_value(); }
    const Error &error() const { return *err_; }
    Status status() const { return err_ ? Status(*err_) : Status(); }
    void set_error(std::string msg);
    // Bytes consumed so far.
    uint64_t pos() const { return pos_; }

private:
    bool fill(size_t need);

    InputStream &in_;
    std::unique_ptr<uint8_t[]> buf_;
    size_t cap_;
    size_t head_ = 0;
    size_t tail_ = 0;
    uint64_t pos_ = 0;
    bool eof_ = false;
    std::optional<Error> err_;
};

// An InputStream over a byte array (tests, captured streams).
class MemoryInputStream : public InputStream {
public:
    MemoryInputStream(const void *data, size_t len)
        : begin_(static_cast<const uint8_t *>(data)), len_(len)
    {
    }
    ssize_t read_some(void *dst, size_t n, std::string *err) override;
    bool seek(uint64_t pos, std::string *err) override;

private:
    const uint8_t *begin_;
    size_t len_;
    size_t at_ = 0;
};

} // namespace qmigd
