#include "protocol/device_state.h"

#include <fmt/format.h>

#include "protocol/qemu_format.h"
#include "protocol/wire.h"

namespace qmigd {

Result<DeviceStateInfo> device_state_check(std::span<const uint8_t> blob)
{
    const size_t n = blob.size();
    if (n > kMaxDeviceState) {
        return Error(fmt::format("device state of {} bytes is larger than {}", n,
                                 kMaxDeviceState));
    }
    if (n == 0 || (blob[0] != QEMU_VM_SECTION_FULL && blob[0] != QEMU_VM_EOF)) {
        return Error("device state does not start with a device section");
    }
    // From the end: the description is JSON, which holds no NUL byte, so
    // the first EOF + VMDESCRIPTION pair whose length reaches exactly to
    // the end is the only one.
    for (size_t k = n >= 6 ? n - 5 : 0; k >= 1; k--) {
        if (blob[k] != QEMU_VM_VMDESCRIPTION || blob[k - 1] != QEMU_VM_EOF ||
            get_be32(&blob[k + 1]) != n - k - 5) {
            continue;
        }
        size_t len = n - k - 5;
        if (len < 2 || blob[k + 5] != '{' || blob[n - 1] != '}') {
            break;
        }
        return DeviceStateInfo{k - 1, len};
    }
    return Error("device state does not end with QEMU_VM_EOF and a VM description: the "
                 "stream was cut short");
}

} // namespace qmigd
