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
#include <span>

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

} // namespace qmigd
