// QEMUFileReader: buffered reads of a migration stream, and its byte readers.
#include "protocol/qemu_file.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "protocol/wire.h"

namespace qmigd {

namespace {
constexpr size_t kReserveAt = 1 << 20;
} // namespace

QEMUFileReader::QEMUFileReader(InputStream &in, size_t buffer_size)
    : in_(in), buf_(new uint8_t[buffer_size]), cap_(buffer_size)
{
}

void QEMUFileReader::set_error(std::string msg)
{
    if (!err_) {
        err_.emplace(std::move(msg));
    }
}

// Makes at least `need` (<= cap_) bytes available; false on EOF/error.
bool QEMUFileReader::fill(size_t need)
{
    if (err_) {
        return false;
    }
    // Keep room for a large read: the stream reaches us a socket read at a
    // time, and a read into a sliver at the end of the buffer would turn one
    // page into several system calls.
    if (head_ > 0 && (cap_ - head_ < need || cap_ - tail_ < cap_ / 4)) {
        std::memmove(buf_.get(), buf_.get() + head_, tail_ - head_);
        tail_ -= head_;
        head_ = 0;
    }
    while (tail_ - head_ < need) {
        if (eof_) {
            return false;
        }
        std::string why;
        ssize_t n = in_.read_some(buf_.get() + tail_, cap_ - tail_, &why);
        if (n < 0) {
            set_error(why);
            return false;
        }
        if (n == 0) {
            eof_ = true;
            return false;
        }
        tail_ += size_t(n);
    }
    return true;
}

void QEMUFileReader::get_buffer(void *dst, size_t n)
{
    auto *out = static_cast<uint8_t *>(dst);
    if (err_ || n == 0) {
        return; // an empty buffer's data() may be null: nothing to copy
    }
    if (n <= cap_ / 4 && tail_ - head_ < n) {
        fill(n); // small: through the buffer, one large read
    }
    size_t have = std::min(n, tail_ - head_);
    std::memcpy(out, buf_.get() + head_, have);
    head_ += have;
    pos_ += have;
    while (have < n) {
        std::string why;
        ssize_t r = in_.read_some(out + have, n - have, &why);
        if (r <= 0) {
            set_error(r < 0 ? why : "unexpected end of migration stream");
            return;
        }
        have += size_t(r);
        pos_ += size_t(r);
    }
}

uint8_t QEMUFileReader::get_byte()
{
    if (!fill(1)) {
        set_error("unexpected end of migration stream");
        return 0;
    }
    pos_++;
    return buf_[head_++];
}

uint16_t QEMUFileReader::get_be16()
{
    uint8_t b[2] = {};
    get_buffer(b, 2);
    return err_ ? 0 : qmigd::get_be16(b);
}

uint32_t QEMUFileReader::get_be32()
{
    uint8_t b[4] = {};
    get_buffer(b, 4);
    return err_ ? 0 : qmigd::get_be32(b);
}

uint64_t QEMUFileReader::get_be64()
{
    uint8_t b[8] = {};
    get_buffer(b, 8);
    return err_ ? 0 : qmigd::get_be64(b);
}

std::string QEMUFileReader::get_cstr8()
{
    uint8_t len = get_byte();
    std::string s(len, '\0');
    get_buffer(s.data(), len);
    return err_ ? std::string() : s;
}

void QEMUFileReader::skip(size_t n)
{
    uint8_t scratch[4096];
    while (n > 0 && !err_) {
        size_t chunk = std::min(n, sizeof(scratch));
        get_buffer(scratch, chunk);
        n -= chunk;
    }
}

int QEMUFileReader::peek_byte()
{
    if (!fill(1)) {
        return -1;
    }
    return buf_[head_];
}

void QEMUFileReader::read_to_end(std::vector<uint8_t> &out, size_t max,
                                 const std::function<bool(std::span<const uint8_t>)> &whole)
{
    size_t start = out.size();
    for (;;) {
        if (err_) {
            return;
        }
        size_t have = tail_ - head_;
        if (out.size() - start + have > max) {
            set_error(fmt::format("more than {} bytes left in the stream", max));
            return;
        }
        if (out.size() - start + have > kReserveAt && out.capacity() < start + max) {
            // Past 1 MiB, room for the most it may take, once: reserved
            // address space costs nothing until written, and no doubling
            // leaves copies in the heap.
            out.reserve(start + max);
        }
        out.insert(out.end(), buf_.get() + head_, buf_.get() + tail_);
        pos_ += have;
        head_ = tail_ = 0;
        if (have && whole && whole(std::span<const uint8_t>(out).subspan(start))) {
            return;
        }
        if (eof_ || !fill(1)) {
            return; // fill() at the end of stream leaves no error
        }
    }
}

ssize_t MemoryInputStream::read_some(void *dst, size_t n, std::string *)
{
    size_t k = std::min(n, len_ - at_);
    if (k == 0) {
        return 0;
    }
    std::memcpy(dst, begin_ + at_, k);
    at_ += k;
    return ssize_t(k);
}

bool MemoryInputStream::seek(uint64_t pos, std::string *)
{
    at_ = size_t(std::min<uint64_t>(pos, len_)); // past the end reads as EOF
    return true;
}

void QEMUFileReader::seek(uint64_t pos)
{
    if (err_) {
        return;
    }
    std::string why;
    if (!in_.seek(pos, &why)) {
        set_error(why);
        return;
    }
    head_ = tail_ = 0;
    eof_ = false;
}

} // namespace qmigd
