// Multifd channel init message and packet header (migration/multifd.h:
// MultiFDInit_t, MultiFDPacket_t), encode and validated decode.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

#include "protocol/error.h"
#include "protocol/qemu_format.h"

namespace qmigd {

void multifd_init_encode(const Uuid &uuid, uint8_t id, uint8_t out[MULTIFD_INIT_SIZE]);

// Checks magic, version, uuid (against ours, as QEMU does whether or not
// validate-uuid is on) and id < channels. Returns the channel id.
Result<uint8_t> multifd_init_decode(const uint8_t in[MULTIFD_INIT_SIZE], const Uuid &uuid,
                                    unsigned channels);

// A decoded, validated packet header: offsets[0..normal) are the pages
// whose data follows the header, offsets[normal..normal+zero) zero pages.
struct MultiFDPacket {
    uint32_t flags = 0;
    uint32_t normal_pages = 0;
    uint32_t zero_pages = 0;
    uint32_t next_packet_size = 0; // bytes of page data after the header
    uint64_t packet_num = 0;
    size_t block = 0; // index into the block table; valid if pages > 0
    std::array<uint64_t, MULTIFD_PACKET_PAGES> offsets{};

    bool is_sync() const { return flags & MULTIFD_FLAG_SYNC; }
    size_t data_bytes() const { return next_packet_size; }
};

// Every check QEMU 10 makes, plus page alignment, offset + page <= length
// and a payload size that fits the pages: normal pages * 4096 without
// compression; with it, nothing for no normal pages, else 1 byte up to
// MULTIFD_COMPRESSED_MAX. `method_flag`: the MULTIFD_FLAG_* of this side's
// multifd-compression, which every packet with pages must carry.
Result<MultiFDPacket> multifd_packet_decode(const uint8_t in[MULTIFD_PACKET_HEADER_SIZE],
                                            std::span<const RamBlockDesc> blocks,
                                            uint32_t method_flag = MULTIFD_FLAG_NOCOMP);

// Fills a 1344-byte header. offsets holds normal then zero page offsets;
// next_packet_size is the payload's size (normal pages * 4096 unless
// compressed).
void multifd_packet_encode(uint8_t out[MULTIFD_PACKET_HEADER_SIZE], uint32_t flags,
                           uint64_t packet_num, std::string_view block_idstr,
                           const uint64_t *offsets, uint32_t normal_pages,
                           uint32_t zero_pages, uint32_t next_packet_size);

} // namespace qmigd
