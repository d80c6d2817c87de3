// The ram section's records (QEMU's ram_load_precopy()): the RAM list of
// the setup section (with its page sizes, addresses and mapped-ram
// headers, or the blocks of a VM being parked), then ZERO, PAGE and XBZRLE
// pages, MULTIFD_FLUSH and EOS. Every block, offset and length from the
// stream is checked here before the handler sees it.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "protocol/loader.h"
#include "protocol/wire.h"
#include "protocol/xbzrle.h"

namespace qmigd {

Result<size_t> Loader::ram_block_from_stream(uint64_t flags)
{
    if (flags & RAM_SAVE_FLAG_CONTINUE) {
        if (!last_block_) {
            return Error("Ack, bad migration stream!");
        }
        return *last_block_;
    }
    std::string idstr = f_->get_cstr8();
    if (f_->failed()) {
        return f_->error();
    }
    for (size_t i = 0; i < blocks_.size(); i++) {
        if (blocks_[i].idstr == idstr) {
            last_block_ = i;
            return i;
        }
    }
    return Error(fmt::format("Can't find block {}", wire_text(idstr)));
}

// Park mode: the stream's block list becomes ours. QEMU's own checks on a
// list (ram_load_precopy) plus the ones a file name needs.
Status Loader::park_mem_size(uint64_t total)
{
    constexpr size_t kMaxBlocks = 256; // a q35 VM has 6, one per ROM and RAM region
    if (!blocks_.empty()) {
        return fail("RAM block list sent twice");
    }
    while (total > 0) {
        std::string idstr = f_->get_cstr8();
        uint64_t length = f_->get_be64();
        QMIGD_TRY(stream_status());
        if (idstr.empty() || idstr.find('\0') != std::string::npos) {
            return fail("RAM block with an empty or NUL-bearing name");
        }
        for (const auto &b : blocks_) {
            if (b.idstr == idstr) {
                return fail(fmt::format("RAM block \"{}\" announced twice", wire_text(idstr)));
            }
        }
        if (length == 0 || length % TARGET_PAGE_SIZE || length > total) {
            return fail(fmt::format("RAM block \"{}\" has a bad length 0x{:x}", wire_text(idstr),
                                    length));
        }
        if (blocks_.size() == kMaxBlocks) {
            return fail(fmt::format("more than {} RAM blocks", kMaxBlocks));
        }
        blocks_.push_back(RamBlockDesc{idstr, length});
        total -= length;
    }
    if (blocks_.empty()) {
        return fail("empty RAM block list");
    }
    return h_.announce_blocks(blocks_);
}

Status Loader::ram_load_mem_size(uint64_t total)
{
    if (cfg_.park) {
        return park_mem_size(total);
    }
    while (total > 0) {
        std::string idstr = f_->get_cstr8();
        uint64_t length = f_->get_be64();
        QMIGD_TRY(stream_status());
        auto it = std::find_if(blocks_.begin(), blocks_.end(),
                               [&](const RamBlockDesc &b) { return b.idstr == idstr; });
        if (it == blocks_.end()) {
            return fail(fmt::format("Unknown ramblock \"{}\", cannot accept migration", wire_text(idstr)));
        }
        if (length != it->used_length) {
            return fail(fmt::format("Size mismatch: {}: 0x{:x} != 0x{:x}: Invalid argument",
                                    wire_text(idstr), length, it->used_length));
        }
        // For postcopy the page sizes must match (ram_load_precopy()).
        if (postcopy_ != PostcopyState::None && cfg_.postcopy_ram &&
            it->page_size != TARGET_PAGE_SIZE) {
            uint64_t remote = f_->get_be64();
            QMIGD_TRY(stream_status());
            if (remote != it->page_size) {
                return fail(fmt::format("Mismatched RAM page size {} (local) {} != {}",
                                        wire_text(idstr), it->page_size, remote));
            }
        }
        // Every qmigd block is a shared memory file, ignored with
        // x-ignore-shared: its address must be ours.
        if (cfg_.ignore_shared) {
            uint64_t addr = f_->get_be64();
            QMIGD_TRY(stream_status());
            if (addr != it->addr) {
                return fail(fmt::format("Mismatched GPAs for block {} {}!= {}", wire_text(idstr),
                                        int64_t(addr), int64_t(it->addr)));
            }
        }
        if (length > total) {
            return fail(fmt::format("RAM block list exceeds the announced total by 0x{:x}",
                                    length - total));
        }
        if (cfg_.mapped_ram) {
            QMIGD_TRY(mapped_ram_load(size_t(it - blocks_.begin()), length));
        }
        total -= length;
    }
    return {};
}

// parse_ramblock_mapped_ram(): the header, the pages (by the handler, from
// the file), then the stream resumes after the block's pages region.
Status Loader::mapped_ram_load(size_t block, uint64_t length)
{
    uint8_t raw[MAPPED_RAM_HEADER_SIZE];
    f_->get_buffer(raw, sizeof(raw));
    if (f_->failed()) {
        return Error(f_->error()).prepend("Could not read whole mapped-ram migration header: ");
    }
    MappedRamHeader h = mapped_ram_header_get(raw);
    QMIGD_TRY(h_.mapped_ram_block(block, h));
    f_->seek(h.pages_offset + length);
    return stream_status();
}

// load_xbzrle(): u8 encoding, be16 length, the delta; applied to the page
// as the destination has it, in QEMU's words when it does not fit.
Status Loader::load_xbzrle(size_t block, uint64_t addr)
{
    uint8_t encoding = f_->get_byte();
    uint16_t len = f_->get_be16();
    QMIGD_TRY(stream_status());
    if (encoding != XBZRLE_ENCODING_FLAG) {
        return fail("Failed to load XBZRLE page - wrong compression!");
    }
    if (len > TARGET_PAGE_SIZE) {
        return fail("Failed to load XBZRLE page - len overflow!");
    }
    uint8_t delta[TARGET_PAGE_SIZE];
    f_->get_buffer(delta, len);
    QMIGD_TRY(stream_status());
    QMIGD_TRY(h_.read_page(block, addr, page_));
    if (xbzrle_decode(delta, len, page_, TARGET_PAGE_SIZE) < 0) {
        return fail("Failed to load XBZRLE page - decode error!");
    }
    QMIGD_TRY(h_.put_page(block, addr, page_));
    result_.xbzrle_pages++;
    return {};
}

Status Loader::ram_load(uint8_t type)
{
    for (;;) {
        uint64_t word = f_->get_be64();
        QMIGD_TRY(stream_status());
        uint64_t flags = word & ~TARGET_PAGE_MASK;
        uint64_t addr = word & TARGET_PAGE_MASK;

        switch (flags & ~RAM_SAVE_FLAG_CONTINUE) {
        case RAM_SAVE_FLAG_MEM_SIZE:
            if (type != QEMU_VM_SECTION_START) {
                return fail("RAM layout record outside the ram START section");
            }
            QMIGD_TRY(ram_load_mem_size(addr));
            break;
        case RAM_SAVE_FLAG_XBZRLE: {
            auto block = ram_block_from_stream(flags);
            QMIGD_TRY(block);
            if (addr >= blocks_[*block].used_length) {
                return fail(fmt::format("Illegal RAM offset {:x}", addr));
            }
            QMIGD_TRY(load_xbzrle(*block, addr));
            break;
        }
        case RAM_SAVE_FLAG_ZERO:
        case RAM_SAVE_FLAG_PAGE: {
            auto block = ram_block_from_stream(flags);
            QMIGD_TRY(block);
            if (addr >= blocks_[*block].used_length) {
                return fail(fmt::format("Illegal RAM offset {:x}", addr));
            }
            if ((flags & ~RAM_SAVE_FLAG_CONTINUE) == RAM_SAVE_FLAG_ZERO) {
                uint8_t ch = f_->get_byte();
                QMIGD_TRY(stream_status());
                if (ch != 0) {
                    return fail(fmt::format("Found a zero page with value {}", ch));
                }
                QMIGD_TRY(h_.zero_page(*block, addr));
                result_.zero_pages++;
            } else {
                f_->get_buffer(page_, TARGET_PAGE_SIZE);
                QMIGD_TRY(stream_status());
                QMIGD_TRY(h_.put_page(*block, addr, page_));
                result_.normal_pages++;
            }
            break;
        }
        case RAM_SAVE_FLAG_MULTIFD_FLUSH:
            if (!cfg_.multifd) {
                // The source has multifd on: its flush came before the
                // destination saw its multifd channels arrive.
                return fail("MULTIFD_FLUSH received but multifd is off here: the source has "
                            "the multifd capability on, this destination has it off: turn it "
                            "on at both ends or neither");
            }
            QMIGD_TRY(h_.multifd_flush());
            result_.flushes++;
            break;
        case RAM_SAVE_FLAG_EOS:
            return {};
        default:
            return fail(fmt::format("Unknown combination of migration flags: 0x{:x}", flags));
        }
    }
}

} // namespace qmigd
