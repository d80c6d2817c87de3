// Constants of QEMU 10's migration stream (savevm.c, ram.c, multifd.h).
// See docs/wire-format.md for the layouts they belong to.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace qmigd {

// x86_64 target pages (TARGET_PAGE_BITS = 12).
constexpr unsigned TARGET_PAGE_BITS = 12;
constexpr uint64_t TARGET_PAGE_SIZE = uint64_t(1) << TARGET_PAGE_BITS;
constexpr uint64_t TARGET_PAGE_MASK = ~(TARGET_PAGE_SIZE - 1);

// File header.
constexpr uint32_t QEMU_VM_FILE_MAGIC = 0x5145564d; // "QEVM"
constexpr uint32_t QEMU_VM_FILE_VERSION_COMPAT = 2;
constexpr uint32_t QEMU_VM_FILE_VERSION = 3;

// Section type bytes.
enum : uint8_t {
    QEMU_VM_EOF = 0x00,
    QEMU_VM_SECTION_START = 0x01,
    QEMU_VM_SECTION_PART = 0x02,
    QEMU_VM_SECTION_END = 0x03,
    QEMU_VM_SECTION_FULL = 0x04,
    QEMU_VM_SUBSECTION = 0x05,
    QEMU_VM_VMDESCRIPTION = 0x06,
    QEMU_VM_CONFIGURATION = 0x07,
    QEMU_VM_COMMAND = 0x08,
    QEMU_VM_SECTION_FOOTER = 0x7e,
};

// COMMAND records (migration/savevm.c enum qemu_vm_cmd).
enum : uint16_t {
    MIG_CMD_INVALID = 0,
    MIG_CMD_OPEN_RETURN_PATH = 1,
    MIG_CMD_PING = 2,
    MIG_CMD_POSTCOPY_ADVISE = 3,
    MIG_CMD_POSTCOPY_LISTEN = 4,
    MIG_CMD_POSTCOPY_RUN = 5,
    MIG_CMD_POSTCOPY_RAM_DISCARD = 6,
    MIG_CMD_PACKAGED = 7,
    MIG_CMD_ENABLE_COLO = 8,
    MIG_CMD_POSTCOPY_RESUME = 9,
    MIG_CMD_RECV_BITMAP = 10,
    MIG_CMD_SWITCHOVER_START = 11,
    MIG_CMD_MAX = 12,
};

// QEMU's mig_cmd_args and rp_cmd_args: a command's or return path
// message's payload length (-1: variable) and its name.
struct MessageArgs {
    int len;
    const char *name;
};

// RAM record flags, the low bits of each ram record's header word.
enum : uint64_t {
    RAM_SAVE_FLAG_ZERO = 0x002,
    RAM_SAVE_FLAG_MEM_SIZE = 0x004,
    RAM_SAVE_FLAG_PAGE = 0x008,
    RAM_SAVE_FLAG_EOS = 0x010,
    RAM_SAVE_FLAG_CONTINUE = 0x020,
    RAM_SAVE_FLAG_XBZRLE = 0x040,
    RAM_SAVE_FLAG_HOOK = 0x080,
    RAM_SAVE_FLAG_MULTIFD_FLUSH = 0x200,
};

// Section versions and bodies of the devices a QEMU 10 -M none guest saves.
constexpr uint32_t RAM_SECTION_VERSION = 4;
constexpr uint32_t TIMER_SECTION_VERSION = 2;
constexpr size_t TIMER_BODY_SIZE = 24;
constexpr uint32_t GLOBALSTATE_SECTION_VERSION = 1;
constexpr size_t GLOBALSTATE_BODY_SIZE = 104;
constexpr size_t GLOBALSTATE_RUNSTATE_SIZE = 32;

// Multifd (migration/multifd.h).
constexpr uint32_t MULTIFD_MAGIC = 0x11223344;
constexpr uint32_t MULTIFD_VERSION = 1;
constexpr uint32_t MULTIFD_FLAG_SYNC = 1u << 0;
constexpr uint32_t MULTIFD_FLAG_COMPRESSION_MASK = 0x3e;
constexpr uint32_t MULTIFD_FLAG_NOCOMP = 0u << 1;
constexpr uint32_t MULTIFD_FLAG_ZLIB = 1u << 1;
constexpr uint32_t MULTIFD_FLAG_ZSTD = 2u << 1;
constexpr uint32_t MULTIFD_FLAG_QPL = 4u << 1;
constexpr uint32_t MULTIFD_FLAG_UADK = 8u << 1;
constexpr uint32_t MULTIFD_FLAG_QATZIP = 16u << 1;
constexpr uint32_t MULTIFD_FLAG_DEVICE_STATE = 1u << 6;
// The configuration section's machine type: qmigd's bound (QEMU has none;
// machine names are a few dozen bytes).
constexpr size_t kMaxMachineTypeName = 256;
constexpr size_t MULTIFD_INIT_SIZE = 64;
constexpr uint32_t MULTIFD_PACKET_PAGES = 128; // 512 KiB / TARGET_PAGE_SIZE
constexpr size_t MULTIFD_RAMBLOCK_NAME_SIZE = 256;
constexpr size_t MULTIFD_PACKET_FIXED_SIZE = 64 + MULTIFD_RAMBLOCK_NAME_SIZE;
constexpr size_t MULTIFD_PACKET_HEADER_SIZE =
    MULTIFD_PACKET_FIXED_SIZE + MULTIFD_PACKET_PAGES * 8; // 1344
constexpr size_t MULTIFD_PACKET_SIZE = MULTIFD_PACKET_PAGES * TARGET_PAGE_SIZE; // uncompressed
// The most compressed data a packet may carry: what a QEMU 10 receiver
// reserves ("twice the size of the packet"); every compressor's bound for
// 512 KiB is below it.
constexpr size_t MULTIFD_COMPRESSED_MAX = 2 * MULTIFD_PACKET_SIZE;

using Uuid = std::array<uint8_t, 16>;

// "12345678-1234-..." text form, as QEMU prints it.
std::string uuid_to_string(const Uuid &uuid);
// Parses the text form; returns false on bad syntax.
bool uuid_parse(const std::string &text, Uuid *out);

// A RAMBlock as both ends of a migration must agree on it.
struct RamBlockDesc {
    std::string idstr;
    uint64_t used_length = 0;
    // QEMU's block->page_size: the huge page size on hugetlbfs, else the
    // host page. Postcopy places and sends whole pages of this size, and
    // with postcopy-ram the RAM list carries it where it is not 4096.
    uint64_t page_size = TARGET_PAGE_SIZE;
    // QEMU's block->mr->addr, the guest-physical address of the block's
    // memory region (0 for a -M none memory backend). With x-ignore-shared
    // the RAM list carries it and the destination checks it.
    uint64_t addr = 0;
};

} // namespace qmigd
