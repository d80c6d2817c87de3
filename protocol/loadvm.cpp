// qemu_loadvm_state(): the loader's sections, commands and park mode after the configuration.
#include "protocol/loadvm.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <string_view>

#include <fmt/format.h>

#include "protocol/device_state.h"
#include "protocol/dirty_bitmap_section.h"
#include "protocol/iterable_state.h"
#include "protocol/savevm.h"
#include "protocol/loader.h"
#include "protocol/wire.h"

namespace qmigd {

Status Loader::load_section_start(uint8_t type)
{
    uint32_t id = f_->get_be32();
    std::string idstr = f_->get_cstr8();
    uint32_t instance = f_->get_be32();
    uint32_t version = f_->get_be32();
    QMIGD_TRY(stream_status());

    SectionKind kind;
    uint32_t max_version;
    if (idstr == "ram" && instance == 0) {
        kind = SectionKind::Ram;
        max_version = RAM_SECTION_VERSION;
    } else if (idstr == "timer" && instance == 0) {
        kind = SectionKind::Timer;
        max_version = TIMER_SECTION_VERSION;
    } else if (idstr == "globalstate" && instance == 0) {
        kind = SectionKind::GlobalState;
        max_version = GLOBALSTATE_SECTION_VERSION;
    } else if (idstr == DIRTY_BITMAP_SECTION && instance == 0) {
        kind = SectionKind::DirtyBitmap;
        max_version = DIRTY_BITMAP_SECTION_VERSION;
    } else {
        return fail(fmt::format("Unknown savevm section or instance '{}' {}. Make sure that "
                                "your current VM setup matches your saved VM setup, "
                                "including any hotplugged devices",
                                wire_text(idstr), instance));
    }
    if (version != max_version) {
        return fail(fmt::format("savevm: unsupported version {} for '{}' v{}", version, wire_text(idstr),
                                max_version));
    }
    bool iterable = kind == SectionKind::Ram || kind == SectionKind::DirtyBitmap;
    if (iterable && type != QEMU_VM_SECTION_START) {
        return fail(fmt::format("{} must be sent as START/PART/END sections", wire_text(idstr)));
    }
    if (!iterable && type != QEMU_VM_SECTION_FULL) {
        return fail(fmt::format("{} must be sent as a FULL section", wire_text(idstr)));
    }
    if (sections_.count(id) == 0 && sections_.size() >= kMaxSections) {
        return fail("too many sections");
    }
    if (kind == SectionKind::Ram) {
        result_.ram_section_id = id;
    }
    sections_[id] = SectionInfo{kind, idstr};
    if (kind == SectionKind::DirtyBitmap) {
        return load_iterable(type, id, sections_[id], instance, version);
    }
    QMIGD_TRY(load_body(sections_[id], type));
    return check_footer(id, sections_[id]);
}

Status Loader::load_section_part(uint8_t type)
{
    uint32_t id = f_->get_be32();
    QMIGD_TRY(stream_status());
    auto it = sections_.find(id);
    if (it == sections_.end()) {
        return fail(fmt::format("Unknown savevm section {}", id));
    }
    if (it->second.kind == SectionKind::DirtyBitmap) {
        return load_iterable(type, id, it->second, 0, 0);
    }
    if (it->second.kind != SectionKind::Ram) {
        return fail(fmt::format("Unexpected PART/END for section '{}'", wire_text(it->second.idstr)));
    }
    QMIGD_TRY(load_body(it->second, type));
    QMIGD_TRY(check_footer(id, it->second));
    ram_ended_ = ram_ended_ || type == QEMU_VM_SECTION_END;
    return {};
}

// qmigd has no disks: a dirty-bitmap section is read to its end and, when
// parking, kept whole (its header and footer rebuilt as they came) for the
// stream that resumes the VM.
Status Loader::load_iterable(uint8_t type, uint32_t id, const SectionInfo &s,
                             uint32_t instance, uint32_t version)
{
    std::vector<uint8_t> section;
    ByteWriter w(section);
    if (type == QEMU_VM_SECTION_START) {
        savevm_put_section_header(w, type, id, s.idstr, instance, version);
    } else {
        savevm_put_section_continue(w, type, id);
    }
    // The most this section may hold: the cap on them all, less what is
    // kept already, its length word and its footer.
    size_t kept = result_.iterable_state.size() + 4 + 5;
    size_t room = kept < kMaxIterableState ? kMaxIterableState - kept : 0;
    QMIGD_TRY(dirty_bitmap_section_read(*f_, cfg_.park ? &section : nullptr, room));
    QMIGD_TRY(check_footer(id, s));
    if (cfg_.park) {
        savevm_put_footer(w, id);
        QMIGD_TRY(iterable_state_append(result_.iterable_state, section));
    }
    return {};
}

Status Loader::load_body(const SectionInfo &s, uint8_t type)
{
    switch (s.kind) {
    case SectionKind::Ram:
        return ram_load(type);
    case SectionKind::Timer:
        f_->skip(TIMER_BODY_SIZE);
        return stream_status();
    case SectionKind::GlobalState:
        return globalstate_load();
    case SectionKind::DirtyBitmap:
        break; // load_iterable()
    }
    return fail("unreachable section kind");
}

Status Loader::check_footer(uint32_t id, const SectionInfo &s)
{
    uint8_t b = f_->get_byte();
    QMIGD_TRY(stream_status());
    if (b != QEMU_VM_SECTION_FOOTER) {
        return fail(fmt::format("Missing section footer for {}", wire_text(s.idstr)));
    }
    uint32_t got = f_->get_be32();
    QMIGD_TRY(stream_status());
    if (got != id) {
        return fail(fmt::format("Mismatched section id in footer for {} - read 0x{:x} "
                                "expected 0x{:x}",
                                wire_text(s.idstr), got, id));
    }
    return {};
}

Status Loader::globalstate_load()
{
    uint8_t body[GLOBALSTATE_BODY_SIZE];
    f_->get_buffer(body, sizeof(body));
    QMIGD_TRY(stream_status());
    uint32_t size = get_be32(body);
    const char *name = reinterpret_cast<const char *>(body + 4);
    size_t len = strnlen(name, GLOBALSTATE_RUNSTATE_SIZE);
    if (size > GLOBALSTATE_RUNSTATE_SIZE || len == GLOBALSTATE_RUNSTATE_SIZE) {
        return fail("globalstate: runstate is not a terminated string");
    }
    std::string runstate(name, len);
    if (std::find(kRunStates.begin(), kRunStates.end(), runstate) == kRunStates.end()) {
        return fail(fmt::format("globalstate: unknown runstate '{}'", wire_text(runstate)));
    }
    result_.runstate = runstate;
    return {};
}

Status Loader::skip_vmdesc()
{
    // Optional: QEMU always sends it, reads and discards it.
    if (f_->peek_byte() != QEMU_VM_VMDESCRIPTION) {
        return {};
    }
    f_->get_byte();
    uint32_t len = f_->get_be32();
    QMIGD_TRY(stream_status());
    if (len > kMaxVmDescription) {
        return fail(fmt::format("VM description too long ({} bytes)", len));
    }
    f_->skip(len);
    return stream_status();
}

// Park mode, where the device state begins (precopy's first device
// section, postcopy's package): a VM is whole only with its RAM.
Status Loader::park_check_ram()
{
    if (blocks_.empty()) {
        return fail("the stream sent no RAM block list: qmigd cannot park this VM");
    }
    return {};
}

// Park mode, at the first device section after RAM: the rest of the
// stream, up to its end or to the end of a whole record (a source with a
// return path waits for our SHUT before it closes).
Status Loader::park_device_state()
{
    if (!ram_ended_) {
        return fail("a device section came before the end of RAM: qmigd cannot park this VM "
                    "(device state has no length on the wire)");
    }
    QMIGD_TRY(park_check_ram());
    DeviceStateEnd end;
    f_->read_to_end(result_.device_state, kMaxDeviceState,
                    [&end](std::span<const uint8_t> ds) { return end.whole(ds); });
    if (f_->failed()) {
        return Error(f_->error()).prepend("device state: ");
    }
    auto info = device_state_check(result_.device_state);
    return info.status();
}

Result<LoadvmResult> Loader::run()
{
    QMIGD_TRY(load_header());
    QMIGD_TRY(load_configuration());
    h_.loading_started();
    QMIGD_TRY(load_main());
    return result_;
}

Result<LoadvmResult> Loader::resume(QEMUFileReader &f)
{
    f_ = &f;
    recovering_ = true;
    QMIGD_TRY(load_main());
    return result_;
}

// qemu_loadvm_state_main(): sections and commands until EOF.
Status Loader::load_main()
{
    for (;;) {
        // Parking: the device state is kept as it comes after RAM, unless
        // a postcopy package brought it already.
        if (int next = f_->peek_byte(); cfg_.park && !result_.postcopy &&
                                        (next == QEMU_VM_SECTION_FULL || next == QEMU_VM_EOF)) {
            return park_device_state();
        }
        uint8_t type = f_->get_byte();
        QMIGD_TRY(stream_status());
        switch (type) {
        case QEMU_VM_SECTION_START:
        case QEMU_VM_SECTION_FULL:
            QMIGD_TRY(load_section_start(type));
            break;
        case QEMU_VM_SECTION_PART:
        case QEMU_VM_SECTION_END:
            QMIGD_TRY(load_section_part(type));
            break;
        case QEMU_VM_COMMAND:
            QMIGD_TRY(load_command());
            break;
        case QEMU_VM_EOF:
            // No VM description follows in postcopy (should_send_vmdesc()),
            // and the source waits for our SHUT: do not wait for one.
            if (!result_.postcopy) {
                QMIGD_TRY(skip_vmdesc());
            }
            return {};
        default:
            return Error(fmt::format("Unknown savevm section type {}", type));
        }
    }
}

// QEMU's postcopy_preempt_thread() is done at the first EOS (the
// source's postcopy_preempt_shutdown_file()): one ram_load() to it. A
// channel that ends before its first record ends cleanly too.
Result<LoadvmResult> Loader::run_ram_records()
{
    if (f_->peek_byte() >= 0) {
        QMIGD_TRY(ram_load(QEMU_VM_SECTION_PART));
    }
    QMIGD_TRY(stream_status());
    return result_;
}

Result<LoadvmResult> qemu_loadvm_state(QEMUFileReader &f, const LoadvmConfig &cfg,
                                       LoadvmHandler &handler)
{
    Loader loader(&f, cfg, handler);
    return loader.run();
}

LoadvmSession::LoadvmSession(const LoadvmConfig &cfg, LoadvmHandler &handler)
    : cfg_(cfg), loader_(std::make_unique<Loader>(nullptr, cfg_, handler))
{
}

LoadvmSession::~LoadvmSession() = default;

Result<LoadvmResult> LoadvmSession::load(QEMUFileReader &f)
{
    loader_->set_reader(&f);
    return loader_->run();
}

Result<LoadvmResult> LoadvmSession::resume(QEMUFileReader &f)
{
    return loader_->resume(f);
}

bool LoadvmSession::in_postcopy() const
{
    return loader_->in_postcopy();
}

Result<LoadvmResult> qemu_load_preempt_channel(QEMUFileReader &f, const LoadvmConfig &cfg,
                                               LoadvmHandler &handler)
{
    Loader loader(&f, cfg, handler);
    return loader.run_ram_records();
}

} // namespace qmigd
