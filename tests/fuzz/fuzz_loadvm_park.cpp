// libFuzzer target: a parking destination's loader (the blocks, the
// iterable sections and the device state all come from the stream and are
// kept) fed by a source that never stops: the input, then its tail
// repeated (repeating_stream.h). Run under -rss_limit_mb/-malloc_limit_mb
// (tests/fuzz/CMakeLists.txt): every buffer filled from the wire must be
// bounded while it fills, so an endless stream ends in an error or in
// constant memory, never in an out-of-memory report.
#include <cstdint>

#include "park_ram.h"
#include "protocol/device_state.h"
#include "protocol/iterable_state.h"
#include "protocol/loadvm.h"
#include "repeating_stream.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (bool postcopy : {false, true}) {
        LoadvmConfig cfg;
        cfg.park = true;
        cfg.multifd = true;
        cfg.postcopy_ram = postcopy;
        RepeatingInputStream in(data, size);
        QEMUFileReader f(in, 4096);
        ParkRam ram;
        auto r = qemu_loadvm_state(f, cfg, ram);
        if (r.ok() && !device_state_check(r->device_state).ok()) {
            __builtin_trap(); // parked a device state that is not whole
        }
        if (r.ok() && !iterable_state_split(r->iterable_state).ok()) {
            __builtin_trap(); // kept iterable sections it could not read back
        }
    }
    return 0;
}
