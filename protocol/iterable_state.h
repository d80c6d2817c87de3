// Iterable sections other than RAM's that a parked VM keeps (today QEMU's
// "dirty-bitmap", protocol/dirty_bitmap_section.h): each whole section as
// it came (header, body, footer), behind a be32 length of qmigd's own, in
// stream order. A resumed VM's stream carries their START sections after
// RAM's setup and their PART and END sections after RAM's end, as QEMU
// orders its handlers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "protocol/error.h"

namespace qmigd {

// Bitmaps of a few disks are KiB to MiB; more is a broken or hostile peer.
constexpr size_t kMaxIterableState = 64 << 20;

struct IterableSection {
    uint8_t type = 0; // QEMU_VM_SECTION_START, PART or END
    std::span<const uint8_t> bytes; // the whole section
};

// Appends one section, refusing to grow past kMaxIterableState.
Status iterable_state_append(std::vector<uint8_t> &state, std::span<const uint8_t> section);
// Splits and checks a kept record (it is read back from a directory: input):
// every length inside it, each section's header, body and footer.
Result<std::vector<IterableSection>> iterable_state_split(std::span<const uint8_t> state);

} // namespace qmigd
