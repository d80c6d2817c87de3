// qemu_loadvm_state()'s opening: the stream's header and its configuration section, checked as QEMU does.
#include <string>

#include <fmt/format.h>

#include "protocol/loader.h"
#include "protocol/qemu_format.h"
#include "protocol/wire.h"

namespace qmigd {

Status Loader::load_header()
{
    uint32_t magic = f_->get_be32();
    uint32_t version = f_->get_be32();
    QMIGD_TRY(stream_status());
    if (magic != QEMU_VM_FILE_MAGIC) {
        return fail(fmt::format("Not a migration stream (magic 0x{:08x})", magic));
    }
    if (version == QEMU_VM_FILE_VERSION_COMPAT) {
        return fail("SaveVM v2 format is obsolete and don't work anymore");
    }
    if (version != QEMU_VM_FILE_VERSION) {
        return fail(fmt::format("Unsupported migration stream version {}", version));
    }
    return {};
}

Status Loader::load_configuration()
{
    if (f_->get_byte() != QEMU_VM_CONFIGURATION) {
        QMIGD_TRY(stream_status());
        return fail("Configuration section missing");
    }
    uint32_t len = f_->get_be32();
    QMIGD_TRY(stream_status());
    if (len > kMaxMachineTypeName) {
        return fail(fmt::format("Machine type name too long ({} bytes)", len));
    }
    if (cfg_.park && len == 0) {
        // A QEMU source always names its machine; a resume must name it.
        return fail("the stream names no machine type: qmigd cannot park this VM");
    }
    std::string name(len, '\0');
    f_->get_buffer(name.data(), len);
    QMIGD_TRY(stream_status());
    result_.machine_type = name;
    // QEMU compares only the received prefix; we compare exactly.
    if (!cfg_.park && name != cfg_.machine_type) {
        return fail(fmt::format("Machine type received is '{}' and local is '{}'", wire_text(name),
                                cfg_.machine_type));
    }
    // Subsections follow with no terminator; at top level the next section
    // type can never be QEMU_VM_SUBSECTION, so the byte alone decides.
    while (f_->peek_byte() == QEMU_VM_SUBSECTION) {
        QMIGD_TRY(load_config_subsection());
    }
    QMIGD_TRY(stream_status());
    return check_capabilities();
}

// configuration/capabilities: be32 count, count x cstr8 name: the
// capabilities QEMU validates, x-ignore-shared and mapped-ram.
Status Loader::load_capabilities()
{
    uint32_t count = f_->get_be32();
    QMIGD_TRY(stream_status());
    if (count > 64) {
        return fail(fmt::format("Too many capabilities in the configuration ({})", count));
    }
    for (uint32_t i = 0; i < count; i++) {
        std::string cap = f_->get_cstr8();
        QMIGD_TRY(stream_status());
        if (cap == "mapped-ram") {
            source_mapped_ram_ = true;
        } else if (cap == "x-ignore-shared") {
            source_ignore_shared_ = true;
        } else {
            return fail(fmt::format("Received unknown capability {}", wire_text(cap)));
        }
    }
    return {};
}

// configuration_validate_capabilities(): both sides on or both off.
Status Loader::check_capabilities()
{
    if (source_ignore_shared_ != cfg_.ignore_shared) {
        return fail(fmt::format("Capability x-ignore-shared is {}, but received capability is {}",
                                cfg_.ignore_shared ? "on" : "off",
                                source_ignore_shared_ ? "on" : "off"));
    }
    if (source_mapped_ram_ != cfg_.mapped_ram) {
        return fail(fmt::format("Capability mapped-ram is {}, but received capability is {}",
                                cfg_.mapped_ram ? "on" : "off",
                                source_mapped_ram_ ? "on" : "off"));
    }
    return {};
}

Status Loader::load_config_subsection()
{
    f_->get_byte();
    std::string name = f_->get_cstr8();
    uint32_t version = f_->get_be32();
    QMIGD_TRY(stream_status());
    if (version != 1) {
        return fail(fmt::format("Unsupported version {} of {}", version, wire_text(name)));
    }
    if (name == "configuration/target-page-bits") {
        uint32_t bits = f_->get_be32();
        QMIGD_TRY(stream_status());
        if (bits != TARGET_PAGE_BITS) {
            return fail(fmt::format("Received TARGET_PAGE_BITS is {} but local is {}", bits,
                                    TARGET_PAGE_BITS));
        }
        return {};
    }
    if (name == "configuration/capabilities") {
        return load_capabilities();
    }
    if (name == "configuration/uuid") {
        Uuid uuid;
        f_->get_buffer(uuid.data(), uuid.size());
        QMIGD_TRY(stream_status());
        result_.uuid = uuid;
        if (cfg_.uuid != Uuid{} && uuid != cfg_.uuid) {
            return fail(fmt::format("UUID received is {} and local is {}",
                                    uuid_to_string(uuid), uuid_to_string(cfg_.uuid)));
        }
        return {};
    }
    return fail(fmt::format("Unknown configuration subsection '{}'", wire_text(name)));
}

} // namespace qmigd
