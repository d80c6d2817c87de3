// The stream after RAM that qmigd keeps: device sections, EOF and the VM description, found and checked.
#include "protocol/device_state.h"

#include <cstring>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

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

namespace {

using nlohmann::json;

constexpr const char *kPackagedNote = "device state of a postcopy package";
// The largest description taken for a record's end: a q35 VM's is ~60 KiB
// (a CPU's ~15 KiB), and parsing one costs up to ~20x its size in memory.
constexpr size_t kMaxDescribedVmdesc = 4 << 20;
constexpr const char *kSectionsBytes = "qmigd-sections-bytes";

bool is_count(const json &j, const char *key)
{
    return j.contains(key) && j[key].is_number_unsigned() &&
           j[key].get<uint64_t>() <= kMaxDeviceState;
}

// The bytes a description (a device's, or a subsection's) stands for on
// the wire (vmstate_save_state_v()): each field's "size" (what its element
// wrote, nested structs included), times "array_len" for an array QEMU
// describes by its first element; then each subsection with its header
// (QEMU_VM_SUBSECTION, u8 length, name, be32 version). Nullopt for
// anything that is not such a description.
std::optional<uint64_t> described_bytes(const json &d, int depth)
{
    if (!d.is_object() || depth > 8) {
        return std::nullopt;
    }
    uint64_t total = 0;
    if (d.contains("fields")) {
        if (!d["fields"].is_array()) {
            return std::nullopt;
        }
        for (const json &f : d["fields"]) {
            if (!f.is_object() || !is_count(f, "size") ||
                (f.contains("array_len") && !is_count(f, "array_len"))) {
                return std::nullopt;
            }
            uint64_t n = f.contains("array_len") ? f["array_len"].get<uint64_t>() : 1;
            total += f["size"].get<uint64_t>() * n; // each <= 64 MiB: no overflow
            if (total > kMaxDeviceState) {
                return std::nullopt;
            }
        }
    }
    if (d.contains("subsections")) {
        if (!d["subsections"].is_array()) {
            return std::nullopt;
        }
        for (const json &sub : d["subsections"]) {
            auto body = described_bytes(sub, depth + 1);
            if (!body || !sub.contains("vmsd_name") || !sub["vmsd_name"].is_string()) {
                return std::nullopt;
            }
            total += 1 + 1 + sub["vmsd_name"].get_ref<const std::string &>().size() + 4 + *body;
            if (total > kMaxDeviceState) {
                return std::nullopt;
            }
        }
    }
    return total;
}

// A FULL section's header at `at` for the described device: its size,
// and the section id (for the footer).
std::optional<size_t> device_header(std::span<const uint8_t> s, size_t at, const json &dev,
                                    uint32_t *id)
{
    if (!dev.is_object() || !dev.contains("name") || !dev["name"].is_string() ||
        !is_count(dev, "instance_id")) {
        return std::nullopt;
    }
    const std::string &name = dev["name"].get_ref<const std::string &>();
    const size_t size = 1 + 4 + 1 + name.size() + 4 + 4;
    if (s.size() - at < size || s[at] != QEMU_VM_SECTION_FULL || s[at + 5] != name.size() ||
        std::memcmp(&s[at + 6], name.data(), name.size()) != 0 ||
        get_be32(&s[at + 6 + name.size()]) != dev["instance_id"].get<uint64_t>()) {
        return std::nullopt;
    }
    *id = get_be32(&s[at + 1]);
    return size;
}

} // namespace

std::string device_state_packaged_vmdesc(size_t sections_bytes)
{
    return fmt::format(R"({{"page_size": 4096, "devices": [], "note": "{}", "{}": {}}})",
                       kPackagedNote, kSectionsBytes, sections_bytes);
}

bool device_state_described(std::span<const uint8_t> sections, std::string_view vmdesc)
{
    json d = json::parse(vmdesc.begin(), vmdesc.end(), nullptr, false);
    if (d.is_discarded() || !d.is_object() || !d.contains("devices") ||
        !d["devices"].is_array()) {
        return false;
    }
    if (d.contains(kSectionsBytes)) {
        return d["devices"].empty() && is_count(d, kSectionsBytes) &&
               d[kSectionsBytes].get<uint64_t>() == sections.size();
    }
    size_t at = 0;
    for (const json &dev : d["devices"]) {
        uint32_t id = 0;
        auto header = device_header(sections, at, dev, &id);
        auto body = described_bytes(dev, 0);
        if (!header || !body || *body > sections.size() - at - *header) {
            return false;
        }
        at += *header + *body;
        // The footer every machine type since QEMU 2.4 sends.
        if (sections.size() - at >= 5 && sections[at] == QEMU_VM_SECTION_FOOTER &&
            get_be32(&sections[at + 1]) == id) {
            at += 5;
        }
    }
    return at == sections.size();
}

bool DeviceStateEnd::whole(std::span<const uint8_t> blob)
{
    const size_t n = blob.size();
    if (n > scanned_) {
        const void *z = memrchr(blob.data() + scanned_, 0, n - scanned_);
        if (z) {
            last_nul_ = size_t(static_cast<const uint8_t *>(z) - blob.data());
        }
        scanned_ = n;
    }
    if (n < 8 || blob[n - 1] != '}' || !last_nul_) {
        return false;
    }
    // The description is JSON, which holds no NUL: QEMU_VM_EOF is the last
    // NUL or one of the five before it (the length may hold NULs).
    const size_t z = *last_nul_;
    for (size_t eof = z >= 5 ? z - 5 : 0; eof <= z; eof++) {
        const size_t k = eof + 1; // QEMU_VM_VMDESCRIPTION
        if (blob[eof] != QEMU_VM_EOF || k + 5 >= n || blob[k] != QEMU_VM_VMDESCRIPTION ||
            get_be32(&blob[k + 1]) != n - k - 5 || blob[k + 5] != '{' ||
            n - k - 5 > kMaxDescribedVmdesc) {
            continue;
        }
        auto desc = blob.subspan(k + 5);
        if (device_state_described(blob.first(eof),
                                   std::string_view(reinterpret_cast<const char *>(desc.data()),
                                                    desc.size()))) {
            return true;
        }
    }
    return false;
}

} // namespace qmigd
