// libFuzzer target: a parking destination's loader (the blocks, the
// iterable sections and the device state all come from the stream and are
// kept) fed by a source that never stops: the input, then its tail
// repeated (repeating_stream.h). Run under -rss_limit_mb/-malloc_limit_mb
// (tests/fuzz/CMakeLists.txt): every buffer filled from the wire must be
// bounded while it fills, so an endless stream ends in an error or in
// constant memory, never in an out-of-memory report. The input's last
// byte says how many bytes before it repeat (0: none).
#include <cstdint>

#include "park_ram.h"
#include "repeating_stream.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    // Precopy as it came, then with postcopy-ram (which takes precopy
    // streams too) from the source that never stops: an endless stream
    // costs seconds, so once.
    MemoryInputStream plain(data, size);
    park_load(plain, 4096, false);
    RepeatingInputStream endless(data, size);
    park_load(endless, 4096, true);
    return 0;
}
