// Encoders of the main channel's records: header, configuration, sections, RAM records, EOF.
#include "protocol/savevm.h"

#include "protocol/xbzrle.h"

#include <algorithm>

namespace qmigd {

namespace {

// The VM description QEMU 10.0.2 sends for a -M none guest (debug aid
// only; destinations read and discard it).
constexpr std::string_view kVmDescription =
    R"({"configuration": {"vmsd_name": "configuration", "version": 1, "fields": )"
    R"([{"name": "len", "type": "uint32", "size": 4}, {"name": "name", "type": "buffer", "size": 4}]}, )"
    R"("page_size": 4096, "devices": [{"name": "timer", "instance_id": 0, "vmsd_name": "timer", )"
    R"("version": 2, "fields": [{"name": "cpu_ticks_offset", "type": "int64", "size": 8}, )"
    R"({"name": "unused", "type": "unused_buffer", "size": 8}, {"name": "cpu_clock_offset", )"
    R"("type": "int64", "size": 8}]}, {"name": "globalstate", "instance_id": 0, "vmsd_name": )"
    R"("globalstate", "version": 1, "fields": [{"name": "size", "type": "uint32", "size": 4}, )"
    R"({"name": "runstate", "type": "buffer", "size": 32}, {"name": "has_vm_was_suspended", )"
    R"("type": "uint8", "size": 1}, {"name": "vm_was_suspended", "type": "uint8", "size": 1}, )"
    R"({"name": "unused", "type": "buffer", "size": 66}]}]})";

} // namespace

void savevm_put_header(ByteWriter &w)
{
    w.be32(QEMU_VM_FILE_MAGIC);
    w.be32(QEMU_VM_FILE_VERSION);
}

void savevm_put_configuration(ByteWriter &w, std::string_view machine_type, const Uuid *uuid,
                              std::span<const std::string_view> caps)
{
    w.u8(QEMU_VM_CONFIGURATION);
    w.be32(uint32_t(machine_type.size()));
    w.bytes(machine_type.data(), machine_type.size());
    if (!caps.empty()) { // vmstate_capabilites, before vmstate_uuid
        w.u8(QEMU_VM_SUBSECTION);
        w.cstr8("configuration/capabilities");
        w.be32(1);
        w.be32(uint32_t(caps.size()));
        for (auto c : caps) {
            w.cstr8(c);
        }
    }
    if (uuid) {
        w.u8(QEMU_VM_SUBSECTION);
        w.cstr8("configuration/uuid");
        w.be32(1);
        w.bytes(uuid->data(), uuid->size());
    }
}

void savevm_put_section_header(ByteWriter &w, uint8_t type, uint32_t section_id,
                               std::string_view idstr, uint32_t instance_id,
                               uint32_t version_id)
{
    w.u8(type);
    w.be32(section_id);
    w.cstr8(idstr);
    w.be32(instance_id);
    w.be32(version_id);
}

void savevm_put_section_continue(ByteWriter &w, uint8_t type, uint32_t section_id)
{
    w.u8(type);
    w.be32(section_id);
}

void savevm_put_footer(ByteWriter &w, uint32_t section_id)
{
    w.u8(QEMU_VM_SECTION_FOOTER);
    w.be32(section_id);
}

void savevm_put_command(ByteWriter &w, uint16_t cmd)
{
    w.u8(QEMU_VM_COMMAND);
    w.be16(cmd);
    w.be16(0);
}

void savevm_put_ping(ByteWriter &w, uint32_t value)
{
    w.u8(QEMU_VM_COMMAND);
    w.be16(MIG_CMD_PING);
    w.be16(4);
    w.be32(value);
}

void savevm_put_timer(ByteWriter &w, uint32_t section_id)
{
    savevm_put_section_header(w, QEMU_VM_SECTION_FULL, section_id, "timer", 0,
                              TIMER_SECTION_VERSION);
    // cpu_ticks_offset, unused, cpu_clock_offset: a guest without CPUs has
    // no clock to carry over.
    w.zeros(TIMER_BODY_SIZE);
    savevm_put_footer(w, section_id);
}

void savevm_put_globalstate(ByteWriter &w, uint32_t section_id, std::string_view runstate)
{
    savevm_put_section_header(w, QEMU_VM_SECTION_FULL, section_id, "globalstate", 0,
                              GLOBALSTATE_SECTION_VERSION);
    size_t len = std::min(runstate.size(), GLOBALSTATE_RUNSTATE_SIZE - 1);
    w.be32(uint32_t(len + 1));
    w.bytes(runstate.data(), len);
    w.zeros(GLOBALSTATE_RUNSTATE_SIZE - len);
    w.u8(1); // has_vm_was_suspended
    w.u8(0); // vm_was_suspended
    w.zeros(GLOBALSTATE_BODY_SIZE - 4 - GLOBALSTATE_RUNSTATE_SIZE - 2);
    savevm_put_footer(w, section_id);
}

void savevm_put_eof_and_vmdesc(ByteWriter &w)
{
    w.u8(QEMU_VM_EOF);
    w.u8(QEMU_VM_VMDESCRIPTION);
    w.be32(uint32_t(kVmDescription.size()));
    w.bytes(kVmDescription.data(), kVmDescription.size());
}

void ram_put_mem_size_word(ByteWriter &w, std::span<const RamBlockDesc> blocks)
{
    uint64_t total = 0;
    for (const auto &b : blocks) {
        total += b.used_length;
    }
    w.be64(total | RAM_SAVE_FLAG_MEM_SIZE);
}

void ram_put_block_entry(ByteWriter &w, const RamBlockDesc &block, RamListOptions opts)
{
    w.cstr8(block.idstr);
    w.be64(block.used_length);
    if (opts.postcopy_ram && block.page_size != TARGET_PAGE_SIZE) {
        w.be64(block.page_size);
    }
    if (opts.ignore_shared) {
        w.be64(block.addr);
    }
}

void ram_put_mem_size(ByteWriter &w, std::span<const RamBlockDesc> blocks, RamListOptions opts)
{
    ram_put_mem_size_word(w, blocks);
    for (const auto &b : blocks) {
        ram_put_block_entry(w, b, opts);
    }
}

void ram_put_flag(ByteWriter &w, uint64_t flag) { w.be64(flag); }

size_t RamRecordEncoder::put_header(ByteWriter &w, const RamBlockDesc &block, uint64_t word)
{
    if (&block == last_block_) {
        w.be64(word | RAM_SAVE_FLAG_CONTINUE);
        return 8;
    }
    last_block_ = &block;
    w.be64(word);
    w.cstr8(block.idstr);
    return 8 + 1 + block.idstr.size();
}

size_t RamRecordEncoder::put_page_header(ByteWriter &w, const RamBlockDesc &block,
                                         uint64_t offset)
{
    return put_header(w, block, offset | RAM_SAVE_FLAG_PAGE);
}

size_t RamRecordEncoder::put_xbzrle_page(ByteWriter &w, const RamBlockDesc &block,
                                         uint64_t offset, const uint8_t *encoded, uint16_t len)
{
    size_t n = put_header(w, block, offset | RAM_SAVE_FLAG_XBZRLE);
    w.u8(XBZRLE_ENCODING_FLAG);
    w.be16(len);
    w.bytes(encoded, len);
    return n + 3 + len;
}

size_t RamRecordEncoder::put_zero_page(ByteWriter &w, const RamBlockDesc &block,
                                       uint64_t offset)
{
    size_t n = put_header(w, block, offset | RAM_SAVE_FLAG_ZERO);
    w.u8(0);
    return n + 1;
}

} // namespace qmigd
