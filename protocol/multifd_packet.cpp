// The multifd init message and packet header: encoding, decoding and checks.
#include "protocol/multifd_packet.h"

#include <cstring>

#include <fmt/format.h>

#include "protocol/wire.h"

namespace qmigd {

void multifd_init_encode(const Uuid &uuid, uint8_t id, uint8_t out[MULTIFD_INIT_SIZE])
{
    std::memset(out, 0, MULTIFD_INIT_SIZE);
    put_be32(out, MULTIFD_MAGIC);
    put_be32(out + 4, MULTIFD_VERSION);
    std::memcpy(out + 8, uuid.data(), uuid.size());
    out[24] = id;
}

Result<uint8_t> multifd_init_decode(const uint8_t in[MULTIFD_INIT_SIZE], const Uuid &uuid,
                                    unsigned channels)
{
    uint32_t magic = get_be32(in);
    uint32_t version = get_be32(in + 4);
    if (magic != MULTIFD_MAGIC) {
        return Error(fmt::format("multifd: received packet magic {:x} expected {:x}", magic,
                                 MULTIFD_MAGIC));
    }
    if (version != MULTIFD_VERSION) {
        return Error(fmt::format("multifd: received packet version {} expected {}", version,
                                 MULTIFD_VERSION));
    }
    Uuid got;
    std::memcpy(got.data(), in + 8, got.size());
    uint8_t id = in[24];
    if (got != uuid) {
        return Error(fmt::format("multifd: received uuid '{}' and expected uuid '{}' for "
                                 "channel {}",
                                 uuid_to_string(got), uuid_to_string(uuid), id));
    }
    // QEMU tests id > channels and lets id == channels through; we do not.
    if (id >= channels) {
        return Error(fmt::format("multifd: received channel id {} is greater than number of "
                                 "channels {}",
                                 id, channels));
    }
    return id;
}

namespace {

Status check_counts(uint32_t pages_alloc, uint32_t normal, uint32_t zero, uint32_t next_size,
                    bool compressed)
{
    if (pages_alloc > MULTIFD_PACKET_PAGES) {
        return Error(fmt::format("multifd: received packet with {} pages, expected {}",
                                 pages_alloc, MULTIFD_PACKET_PAGES));
    }
    if (normal > pages_alloc) {
        return Error(fmt::format("multifd: received packet with {} non-zero pages, which "
                                 "exceeds maximum expected pages {}",
                                 normal, pages_alloc));
    }
    if (zero > pages_alloc - normal) {
        return Error(fmt::format("multifd: received packet with {} zero pages, expected "
                                 "maximum {}",
                                 zero, pages_alloc - normal));
    }
    bool fits = compressed ? (normal ? next_size > 0 && next_size <= MULTIFD_COMPRESSED_MAX
                                     : next_size == 0)
                           : uint64_t(next_size) == uint64_t(normal) * TARGET_PAGE_SIZE;
    if (!fits) {
        return Error(fmt::format("multifd: received packet with next_packet_size {} for {} "
                                 "pages",
                                 next_size, normal));
    }
    return {};
}

} // namespace

Result<MultiFDPacket> multifd_packet_decode(const uint8_t in[MULTIFD_PACKET_HEADER_SIZE],
                                            std::span<const RamBlockDesc> blocks,
                                            uint32_t method_flag)
{
    uint32_t magic = get_be32(in);
    uint32_t version = get_be32(in + 4);
    if (magic != MULTIFD_MAGIC) {
        return Error(fmt::format("multifd: received packet magic {:x}, expected {:x}", magic,
                                 MULTIFD_MAGIC));
    }
    if (version != MULTIFD_VERSION) {
        return Error(fmt::format("multifd: received packet version {}, expected {}", version,
                                 MULTIFD_VERSION));
    }
    MultiFDPacket p;
    p.flags = get_be32(in + 8);
    uint32_t pages_alloc = get_be32(in + 12);
    p.normal_pages = get_be32(in + 16);
    p.next_packet_size = get_be32(in + 20);
    p.packet_num = get_be64(in + 24);
    p.zero_pages = get_be32(in + 32);
    if (p.flags & ~(MULTIFD_FLAG_SYNC | MULTIFD_FLAG_COMPRESSION_MASK)) {
        return Error(fmt::format("multifd: flags received {:x} (device state packets are not "
                                 "supported)",
                                 p.flags));
    }
    // QEMU looks at a packet's method only when it has pages.
    uint32_t method = p.flags & MULTIFD_FLAG_COMPRESSION_MASK;
    if ((p.normal_pages || p.zero_pages) && method != method_flag) {
        return Error(fmt::format("multifd: flags received {:x} flags expected {:x}", method,
                                 method_flag));
    }
    QMIGD_TRY(check_counts(pages_alloc, p.normal_pages, p.zero_pages, p.next_packet_size,
                           method_flag != MULTIFD_FLAG_NOCOMP));

    uint32_t pages = p.normal_pages + p.zero_pages;
    if (pages == 0) {
        return p;
    }
    const char *name = reinterpret_cast<const char *>(in + 64);
    std::string_view idstr(name, strnlen(name, MULTIFD_RAMBLOCK_NAME_SIZE - 1));
    size_t b = 0;
    while (b < blocks.size() && blocks[b].idstr != idstr) {
        b++;
    }
    if (b == blocks.size()) {
        return Error(fmt::format("multifd: unknown ram block {}", wire_text(idstr)));
    }
    p.block = b;
    uint64_t length = blocks[b].used_length;
    for (uint32_t i = 0; i < pages; i++) {
        uint64_t off = get_be64(in + MULTIFD_PACKET_FIXED_SIZE + 8 * i);
        if (length < TARGET_PAGE_SIZE || off > length - TARGET_PAGE_SIZE) {
            return Error(fmt::format("multifd: offset too long {} (max {:x})", off, length));
        }
        if (off & ~TARGET_PAGE_MASK) {
            return Error(fmt::format("multifd: unaligned page offset 0x{:x}", off));
        }
        p.offsets[i] = off;
    }
    return p;
}

void multifd_packet_encode(uint8_t out[MULTIFD_PACKET_HEADER_SIZE], uint32_t flags,
                           uint64_t packet_num, std::string_view block_idstr,
                           const uint64_t *offsets, uint32_t normal_pages,
                           uint32_t zero_pages, uint32_t next_packet_size)
{
    std::memset(out, 0, MULTIFD_PACKET_HEADER_SIZE);
    uint32_t pages = normal_pages + zero_pages;
    put_be32(out, MULTIFD_MAGIC);
    put_be32(out + 4, MULTIFD_VERSION);
    put_be32(out + 8, flags);
    put_be32(out + 12, pages ? MULTIFD_PACKET_PAGES : 0);
    put_be32(out + 16, normal_pages);
    put_be32(out + 20, next_packet_size);
    put_be64(out + 24, packet_num);
    put_be32(out + 32, zero_pages);
    if (pages) {
        std::memcpy(out + 64, block_idstr.data(),
                    std::min(block_idstr.size(), MULTIFD_RAMBLOCK_NAME_SIZE - 1));
    }
    for (uint32_t i = 0; i < pages; i++) {
        put_be64(out + MULTIFD_PACKET_FIXED_SIZE + 8 * i, offsets[i]);
    }
}

} // namespace qmigd
