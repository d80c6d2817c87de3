// Big-endian integer helpers and an append-only byte writer.
// Everything on QEMU's migration wire is big-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace qmigd {

// Bytes read off the wire (a machine type, a RAM block name...) as text fit
// for an error message, a log line and a JSON reply: printable ASCII as it
// is, every other byte as \xNN. A peer cannot smuggle invalid UTF-8 or
// control characters into error-desc this way.
inline std::string wire_text(std::string_view bytes)
{
    static const char hex[] = "0123456789abcdef";
    std::string out;
    out.reserve(bytes.size());
    for (unsigned char c : bytes) {
        if (c >= 0x20 && c < 0x7f && c != '\\') {
            out.push_back(char(c));
        } else {
            out += "\\x";
            out.push_back(hex[c >> 4]);
            out.push_back(hex[c & 15]);
        }
    }
    return out;
}

inline uint16_t get_be16(const uint8_t *p) { return uint16_t(p[0] << 8 | p[1]); }

inline uint32_t get_be32(const uint8_t *p)
{
    return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

inline uint64_t get_be64(const uint8_t *p)
{
    return uint64_t(get_be32(p)) << 32 | get_be32(p + 4);
}

inline void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = uint8_t(v >> 24);
    p[1] = uint8_t(v >> 16);
    p[2] = uint8_t(v >> 8);
    p[3] = uint8_t(v);
}

inline void put_be64(uint8_t *p, uint64_t v)
{
    put_be32(p, uint32_t(v >> 32));
    put_be32(p + 4, uint32_t(v));
}

// Little-endian 64-bit words: the host `unsigned long`s of QEMU's bitmaps
// in files (mapped-ram), whatever our own byte order.
inline uint64_t get_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) {
        v = v << 8 | p[k];
    }
    return v;
}

inline void put_le64(uint8_t *p, uint64_t v)
{
    for (int k = 0; k < 8; k++) {
        p[k] = uint8_t(v >> (8 * k));
    }
}

// Appends encoded fields to a caller-owned byte vector, QEMUFile-style
// (qemu_put_byte / qemu_put_be32 / ...). Never fails.
class ByteWriter {
public:
    explicit ByteWriter(std::vector<uint8_t> &out) : out_(out) {}

    void u8(uint8_t v) { out_.push_back(v); }
    void be16(uint16_t v)
    {
        u8(uint8_t(v >> 8));
        u8(uint8_t(v));
    }
    void be32(uint32_t v)
    {
        uint8_t b[4];
        put_be32(b, v);
        bytes(b, 4);
    }
    void be64(uint64_t v)
    {
        uint8_t b[8];
        put_be64(b, v);
        bytes(b, 8);
    }
    void bytes(const void *p, size_t n)
    {
        auto *b = static_cast<const uint8_t *>(p);
        out_.insert(out_.end(), b, b + n);
    }
    // Counted string: u8 length + bytes (no NUL). Caller keeps len <= 255.
    void cstr8(std::string_view s)
    {
        u8(uint8_t(s.size()));
        bytes(s.data(), s.size());
    }
    void zeros(size_t n) { out_.insert(out_.end(), n, 0); }

private:
    std::vector<uint8_t> &out_;
};

} // namespace qmigd
