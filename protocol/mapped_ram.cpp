// The mapped-ram block header and layout: encoding, decoding and their checks.
#include "protocol/mapped_ram.h"

#include <fmt/format.h>

#include "protocol/qemu_format.h"

namespace qmigd {

uint64_t mapped_ram_bitmap_size(uint64_t pages)
{
    return (pages + 63) / 64 * 8;
}

MappedRamHeader mapped_ram_layout(uint64_t header_pos, uint64_t used_length)
{
    MappedRamHeader h;
    h.page_size = TARGET_PAGE_SIZE;
    h.bitmap_offset = header_pos + MAPPED_RAM_HEADER_SIZE;
    uint64_t end = h.bitmap_offset + mapped_ram_bitmap_size(used_length >> TARGET_PAGE_BITS);
    h.pages_offset = (end + MAPPED_RAM_FILE_OFFSET_ALIGNMENT - 1) &
                     ~(MAPPED_RAM_FILE_OFFSET_ALIGNMENT - 1);
    return h;
}

void mapped_ram_header_put(ByteWriter &w, const MappedRamHeader &h)
{
    w.be32(h.version);
    w.be64(h.page_size);
    w.be64(h.bitmap_offset);
    w.be64(h.pages_offset);
}

MappedRamHeader mapped_ram_header_get(const uint8_t (&b)[MAPPED_RAM_HEADER_SIZE])
{
    MappedRamHeader h;
    h.version = get_be32(b);
    h.page_size = get_be64(b + 4);
    h.bitmap_offset = get_be64(b + 12);
    h.pages_offset = get_be64(b + 20);
    return h;
}

Status mapped_ram_header_check(const MappedRamHeader &h, std::string_view idstr,
                               uint64_t used_length, uint64_t file_size)
{
    if (h.version > MAPPED_RAM_HDR_VERSION) {
        return Error(fmt::format("Migration mapped-ram capability version not supported "
                                 "(expected <= {}, got {})",
                                 MAPPED_RAM_HDR_VERSION, h.version));
    }
    if (h.page_size != TARGET_PAGE_SIZE) {
        return Error(fmt::format("mapped-ram: block {} has page size 0x{:x}, expected 0x{:x}",
                                 wire_text(idstr), h.page_size, TARGET_PAGE_SIZE));
    }
    if (h.pages_offset % TARGET_PAGE_SIZE) {
        return Error(fmt::format("Error reading ramblock {} pages, region has bad alignment",
                                 wire_text(idstr)));
    }
    uint64_t bitmap_size = mapped_ram_bitmap_size(used_length >> TARGET_PAGE_BITS);
    if (h.bitmap_offset > file_size || bitmap_size > file_size - h.bitmap_offset) {
        return Error(fmt::format("mapped-ram: bitmap of block {} at 0x{:x}+0x{:x} lies outside "
                                 "the file (0x{:x} bytes)",
                                 wire_text(idstr), h.bitmap_offset, bitmap_size, file_size));
    }
    if (h.pages_offset > file_size || used_length > file_size - h.pages_offset) {
        return Error(fmt::format("mapped-ram: pages of block {} at 0x{:x}+0x{:x} lie outside "
                                 "the file (0x{:x} bytes)",
                                 wire_text(idstr), h.pages_offset, used_length, file_size));
    }
    return {};
}

} // namespace qmigd
