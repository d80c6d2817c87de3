// The iterable sections a parked VM keeps: framing, kept whole and replayed.
#include "protocol/iterable_state.h"

#include <fmt/format.h>

#include "protocol/dirty_bitmap_section.h"
#include "protocol/qemu_file.h"
#include "protocol/qemu_format.h"
#include "protocol/wire.h"

namespace qmigd {

Status iterable_state_append(std::vector<uint8_t> &state, std::span<const uint8_t> section)
{
    if (state.size() + 4 + section.size() > kMaxIterableState) {
        return Error(fmt::format("iterable sections of more than {} bytes", kMaxIterableState));
    }
    ByteWriter w(state);
    w.be32(uint32_t(section.size()));
    w.bytes(section.data(), section.size());
    return {};
}

namespace {

// One kept section: a dirty-bitmap START, PART or END, read to its footer.
Status check_section(std::span<const uint8_t> s)
{
    MemoryInputStream in(s.data(), s.size());
    QEMUFileReader f(in, 4096);
    uint8_t type = f.get_byte();
    uint32_t id = f.get_be32();
    if (type == QEMU_VM_SECTION_START) {
        std::string idstr = f.get_cstr8();
        uint32_t instance = f.get_be32(), version = f.get_be32();
        if (!f.failed() && (idstr != DIRTY_BITMAP_SECTION || instance != 0 ||
                            version != DIRTY_BITMAP_SECTION_VERSION)) {
            return Error(fmt::format("kept section '{}' {} v{} is not a dirty-bitmap section",
                                     wire_text(idstr), instance, version));
        }
    } else if (type != QEMU_VM_SECTION_PART && type != QEMU_VM_SECTION_END) {
        return Error(fmt::format("kept section of type {} is not iterable", type));
    }
    QMIGD_TRY(f.status());
    QMIGD_TRY(dirty_bitmap_section_read(f, nullptr));
    uint8_t footer = f.get_byte();
    uint32_t footer_id = f.get_be32();
    QMIGD_TRY(f.status());
    if (footer != QEMU_VM_SECTION_FOOTER || footer_id != id) {
        return Error("kept section without its footer");
    }
    if (f.pos() != s.size()) {
        return Error("kept section with bytes after its footer");
    }
    return {};
}

} // namespace

Result<std::vector<IterableSection>> iterable_state_split(std::span<const uint8_t> state)
{
    if (state.size() > kMaxIterableState) {
        return Error(fmt::format("iterable sections of more than {} bytes", kMaxIterableState));
    }
    std::vector<IterableSection> out;
    size_t at = 0;
    while (at < state.size()) {
        if (state.size() - at < 4) {
            return Error("iterable sections cut short");
        }
        uint32_t len = get_be32(&state[at]);
        at += 4;
        if (len == 0 || len > state.size() - at) {
            return Error("iterable sections cut short");
        }
        auto s = state.subspan(at, len);
        if (Status st = check_section(s); !st) {
            return Error(st.error()).prepend("iterable sections: ");
        }
        out.push_back({s[0], s});
        at += len;
    }
    return out;
}

} // namespace qmigd
