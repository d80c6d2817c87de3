// The part of a migration stream after RAM that qmigd keeps, without
// interpreting it, when it parks a VM: every device's FULL section, then
// QEMU_VM_EOF and the JSON VM description QEMU appends. Device sections
// carry no length on the wire (vmstate fields are read by their own
// description), so the only way to keep them whole is to keep everything
// from the first of them to the end of the stream; the VM description at
// the very end is what tells a whole record from a cut one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "protocol/error.h"

namespace qmigd {

// A VM's device state is kilobytes to a few MiB (q35, 30 devices: 55 KiB
// with its description); more than this is a broken or hostile peer.
constexpr size_t kMaxDeviceState = 64 << 20;

struct DeviceStateInfo {
    size_t sections_bytes = 0; // the FULL sections, before QEMU_VM_EOF
    size_t vmdesc_bytes = 0;   // the JSON VM description
};

// Checks that blob is a whole device-state record: FULL sections (or
// none), QEMU_VM_EOF, QEMU_VM_VMDESCRIPTION, a be32 length and exactly
// that many bytes of a JSON object.
Result<DeviceStateInfo> device_state_check(std::span<const uint8_t> blob);

// Whether the device state read so far is the whole record, for a source
// that waits for our answer (the return path's SHUT) before it closes:
// the stream has no end to wait for, and the record none of its own on the
// wire. The trailing VM description (QEMU's vmdesc) names each device
// section and the bytes of its fields and subsections; the record is
// whole when its description (of at most 4 MiB) describes exactly the
// sections before it (header, body, footer), so device bytes that only
// look like a record's end (a guest's data in a device buffer) are not
// taken for it. (A guest that forged a description of the bytes before
// its buffer, and had a read end right after it, would cut short only
// its own device state.) Fed the growing record after each read; costs
// O(new bytes) unless the bytes end like a record.
class DeviceStateEnd {
public:
    bool whole(std::span<const uint8_t> blob);

private:
    size_t scanned_ = 0;              // bytes of blob looked at for NULs
    std::optional<size_t> last_nul_;  // the last 0 byte in them
};

// The VM description qmigd gives a device state that came without one (a
// postcopy package's): it describes no device, but says how many bytes of
// sections precede it, which is all DeviceStateEnd needs.
std::string device_state_packaged_vmdesc(size_t sections_bytes);

// The walk DeviceStateEnd makes: `sections` (the FULL sections before
// QEMU_VM_EOF) against `vmdesc` (the VM description's JSON text).
bool device_state_described(std::span<const uint8_t> sections, std::string_view vmdesc);

} // namespace qmigd
