// Encoders for QEMU 10's main migration channel (savevm.c + ram.c framing).
// Pure byte layout: callers decide what to send and when.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "protocol/qemu_format.h"
#include "protocol/wire.h"

namespace qmigd {

// "QEVM" + version 3.
void savevm_put_header(ByteWriter &w);
// QEMU_VM_CONFIGURATION + machine type name. Capabilities the destination
// must have on too (QEMU validates mapped-ram and x-ignore-shared) add the
// configuration/capabilities subsection; a non-zero uuid adds
// configuration/uuid (QEMU's validate-uuid).
void savevm_put_configuration(ByteWriter &w, std::string_view machine_type,
                              const Uuid *uuid = nullptr,
                              std::span<const std::string_view> caps = {});
// START or FULL section header.
void savevm_put_section_header(ByteWriter &w, uint8_t type, uint32_t section_id,
                               std::string_view idstr, uint32_t instance_id,
                               uint32_t version_id);
// PART or END section header.
void savevm_put_section_continue(ByteWriter &w, uint8_t type, uint32_t section_id);
void savevm_put_footer(ByteWriter &w, uint32_t section_id);
// A COMMAND record with no payload (e.g. SWITCHOVER_START).
void savevm_put_command(ByteWriter &w, uint16_t cmd);
// MIG_CMD_PING: the destination answers on the return path with a PONG.
void savevm_put_ping(ByteWriter &w, uint32_t value);
// Whole FULL sections of the devices a -M none guest has.
void savevm_put_timer(ByteWriter &w, uint32_t section_id);
void savevm_put_globalstate(ByteWriter &w, uint32_t section_id, std::string_view runstate);
// QEMU_VM_EOF then the VM description QEMU appends after it.
void savevm_put_eof_and_vmdesc(ByteWriter &w);

// ram section records.
// What a RAM list entry carries after a block's length (ram_save_setup()):
// with postcopy-ram, the page size where it is not the host's (4096);
// with x-ignore-shared, the block's address.
struct RamListOptions {
    bool postcopy_ram = false;
    bool ignore_shared = false;
};
void ram_put_mem_size(ByteWriter &w, std::span<const RamBlockDesc> blocks,
                      RamListOptions opts = {});
// The same in parts, for mapped-ram, whose header follows each block entry:
// the record word (total bytes | MEM_SIZE), then one entry per block.
void ram_put_mem_size_word(ByteWriter &w, std::span<const RamBlockDesc> blocks);
void ram_put_block_entry(ByteWriter &w, const RamBlockDesc &block, RamListOptions opts = {});
// A bare flag word: RAM_SAVE_FLAG_EOS or RAM_SAVE_FLAG_MULTIFD_FLUSH.
void ram_put_flag(ByteWriter &w, uint64_t flag);

// Writes ZERO/PAGE record headers, remembering the last block so that the
// idstr is sent once per block change (RAM_SAVE_FLAG_CONTINUE), across
// sections, as QEMU's save_page_header() does.
class RamRecordEncoder {
public:
    // Header word (+ idstr) of a PAGE record; the caller sends the 4096
    // page bytes next. Returns bytes written.
    size_t put_page_header(ByteWriter &w, const RamBlockDesc &block, uint64_t offset);
    // A whole XBZRLE record: the delta of a page against the copy the
    // destination has (protocol/xbzrle.h). Returns bytes written.
    size_t put_xbzrle_page(ByteWriter &w, const RamBlockDesc &block, uint64_t offset,
                           const uint8_t *encoded, uint16_t len);
    // A whole ZERO record. Returns bytes written.
    size_t put_zero_page(ByteWriter &w, const RamBlockDesc &block, uint64_t offset);
    void reset() { last_block_ = nullptr; }

private:
    size_t put_header(ByteWriter &w, const RamBlockDesc &block, uint64_t word);

    const RamBlockDesc *last_block_ = nullptr;
};

} // namespace qmigd
