// A parked VM's directory: vm.json, its images and device state, written and read back.
#include "daemon/park/parked_vm.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "daemon/io/unique_fd.h"
#include "daemon/socket_io.h"
#include "monitor/json_parse.h"
#include "monitor/qapi_visit.h"
#include "protocol/device_state.h"
#include "protocol/iterable_state.h"

namespace qmigd {

namespace {

constexpr const char *kParkedVmFormat = "qmigd-parked-vm";
constexpr int kVersion = 1;

std::string record_path(const std::string &dir) { return dir + "/vm.json"; }
std::string device_state_path(const std::string &dir) { return dir + "/device-state.bin"; }
std::string iterable_state_path(const std::string &dir) { return dir + "/iterable-state.bin"; }

Error file_error(const char *what, const std::string &path, int err)
{
    return Error(fmt::format("{} '{}': {}", what, path,
                             err == ELOOP ? "is a symbolic link" : std::strerror(err)));
}

// Through a temporary name, so that a reader sees the old file or the
// whole new one; on stable storage (fsync) before the rename, so that the
// name never points at data a crash could lose. The directory entry is
// the caller's to sync (sync_dir). Private (0600), as the RAM images: the
// device state holds the guest's CPU registers and device memory.
Status write_file(const std::string &path, const void *data, size_t len,
                  const std::string &tmp_suffix = ".tmp")
{
    std::string tmp = path + tmp_suffix;
    ::unlink(tmp.c_str()); // a leftover of a park that was killed
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) {
        return file_error("Could not create", tmp, errno);
    }
    Status st = pwrite_full(fd.get(), data, len, 0);
    if (!st) {
        st = Error(st.error()).prepend(fmt::format("'{}': ", tmp));
    } else if (::fsync(fd.get()) != 0) {
        st = file_error("Could not sync", tmp, errno);
    }
    fd.reset();
    if (st && std::rename(tmp.c_str(), path.c_str()) != 0) {
        st = file_error("Could not rename it to", path, errno);
    }
    if (!st) {
        ::unlink(tmp.c_str());
    }
    return st;
}

// A file of the directory, whole: a regular file of at most `max` bytes,
// never a symbolic link, FIFO or device (which could hang or never end).
Result<std::string> read_file(const std::string &path, size_t max)
{
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (!fd) {
        return file_error("Could not open", path, errno);
    }
    struct stat st;
    std::string out;
    Status ok;
    if (fstat(fd.get(), &st) != 0) {
        ok = file_error("Could not stat", path, errno);
    } else if (!S_ISREG(st.st_mode)) {
        ok = Error(fmt::format("'{}' is not a regular file", path));
    } else if (uint64_t(st.st_size) > max) {
        ok = Error(fmt::format("'{}' is larger than {} bytes", path, max));
    } else {
        out.resize(size_t(st.st_size));
        ok = pread_full(fd.get(), out.data(), out.size(), 0);
        if (!ok) {
            ok = Error(ok.error()).prepend(fmt::format("'{}': ", path));
        }
    }
    if (!ok) {
        return ok.error();
    }
    return out;
}

using nlohmann::json;

// UTF-8 as RFC 3629 has it (no overlong forms, no surrogates, at most
// U+10FFFF): what a JSON string can carry.
bool is_utf8(std::string_view s)
{
    for (size_t i = 0; i < s.size();) {
        auto c = static_cast<unsigned char>(s[i]);
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t more = c >= 0xc2 && c <= 0xdf ? 1 : (c & 0xf0) == 0xe0 ? 2
                      : c >= 0xf0 && c <= 0xf4                 ? 3
                                                               : 0;
        if (more == 0 || s.size() - i <= more) {
            return false;
        }
        // The second byte's range rules out overlong forms, surrogates and
        // code points past U+10FFFF.
        auto c1 = static_cast<unsigned char>(s[i + 1]);
        unsigned lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80;
        unsigned hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
        if (c1 < lo || c1 > hi) {
            return false;
        }
        for (size_t k = 2; k <= more; k++) {
            if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) {
                return false;
            }
        }
        i += more + 1;
    }
    return true;
}

// A name from the stream (machine type, block idstr) as the record keeps
// it: a JSON string when it is UTF-8, else its bytes in hex under KEY-hex.
// QEMU's names are bytes, JSON's strings text: either way the resume sends
// back the very bytes that came.
void put_name(json &j, const std::string &key, const std::string &name)
{
    if (is_utf8(name)) {
        j[key] = name;
        return;
    }
    static const char hex[] = "0123456789abcdef";
    std::string h;
    for (unsigned char c : name) {
        h += hex[c >> 4];
        h += hex[c & 15];
    }
    j[key + "-hex"] = h;
}

// The name under KEY or KEY-hex (exactly one of them, strings: the
// visitor checked their types); nullopt otherwise.
std::optional<std::string> get_name(const json &j, const std::string &key)
{
    bool text = j.contains(key), hex = j.contains(key + "-hex");
    if (text == hex) {
        return std::nullopt;
    }
    if (text) {
        return j[key].get<std::string>();
    }
    const std::string &t = j[key + "-hex"].get_ref<const std::string &>();
    if (t.size() % 2) {
        return std::nullopt;
    }
    std::string out;
    for (size_t i = 0; i < t.size(); i += 2) {
        auto nibble = [](char c) {
            return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        };
        int hi = nibble(t[i]), lo = nibble(t[i + 1]);
        if (hi < 0 || lo < 0) {
            return std::nullopt;
        }
        out += char(hi << 4 | lo);
    }
    return out;
}

// vm.json's schema, written as QAPI types so that the monitor's visitor
// checks it with the errors a QMP client gets: names are under KEY (UTF-8)
// or KEY-hex (their bytes in hex), exactly one of them (get_name checks).
const QapiType kParkedBlock = qapi_struct({{"idstr", &kQapiStr, true},
                                           {"idstr-hex", &kQapiStr, true},
                                           {"size", &kQapiUint64},
                                           {"file", &kQapiStr, true}});
const QapiType kParkedBlockList = qapi_list_of(&kParkedBlock);
const QapiType kParkedVmRecord = qapi_struct({{"format", &kQapiStr},
                                              {"version", &kQapiUint32},
                                              {"machine-type", &kQapiStr, true},
                                              {"machine-type-hex", &kQapiStr, true},
                                              {"uuid", &kQapiStr, true},
                                              {"ram-section-id", &kQapiUint32},
                                              {"blocks", &kParkedBlockList},
                                              {"iterable-state-bytes", &kQapiUint64, true},
                                              {"device-state-bytes", &kQapiUint64, true}});

// A JSON integer the visitor took as a uint64 (negatives wrap, as QEMU's).
uint64_t record_uint(const json &v)
{
    return v.is_number_unsigned() ? v.get<uint64_t>() : uint64_t(v.get<int64_t>());
}

// The record's members, their types checked already: what each must hold.
Result<ParkedVm> parse_members(const std::string &dir, const json &j)
{
    auto bad = [&](const char *what) {
        return Error(fmt::format("'{}': {}", record_path(dir), what));
    };
    auto machine = get_name(j, "machine-type");
    if (!machine) {
        return bad("'machine-type' must be a string (or 'machine-type-hex' its bytes in hex)");
    }
    ParkedVm vm;
    vm.dir = dir;
    vm.machine_type = *machine;
    vm.ram_section_id = j["ram-section-id"].get<uint32_t>();
    if (j.contains("uuid")) {
        Uuid u;
        if (!uuid_parse(j["uuid"].get<std::string>(), &u)) {
            return bad("'uuid' must be a UUID string");
        }
        vm.uuid = u;
    }
    std::set<std::string> seen;
    for (const json &b : j["blocks"]) {
        auto idstr = get_name(b, "idstr");
        if (!idstr) {
            return bad("each block needs 'idstr' (a string, or 'idstr-hex' its bytes in hex)");
        }
        const std::string &id = *idstr;
        uint64_t size = record_uint(b["size"]);
        if (id.empty() || id.size() > 255 || size == 0 || size % TARGET_PAGE_SIZE) {
            return bad("a block's idstr must have 1 to 255 bytes and its size be whole pages");
        }
        if (!seen.insert(id).second) {
            return bad("two blocks have one idstr"); // a stream names each block once
        }
        vm.blocks.push_back({id, size});
    }
    if (j.contains("iterable-state-bytes")) {
        uint64_t n = record_uint(j["iterable-state-bytes"]);
        if (n > kMaxIterableState) {
            return bad("'iterable-state-bytes' must be a number of at most 64 MiB");
        }
        vm.iterable_state.resize(size_t(n));
    }
    if (j.contains("device-state-bytes")) {
        vm.device_state_bytes = record_uint(j["device-state-bytes"]);
    }
    return vm;
}

Result<ParkedVm> parse_record(const std::string &dir, const std::string &text)
{
    JsonText parsed = parse_json_text(text);
    json &j = parsed.value;
    if (!j.is_discarded() && parsed.duplicate_key) {
        return Error(fmt::format("'{}': JSON parse error, duplicate key", record_path(dir)));
    }
    if (j.is_discarded() || !j.is_object() || !j.contains("format") ||
        j["format"] != kParkedVmFormat) {
        return Error(fmt::format("'{}' is not a parked VM record", record_path(dir)));
    }
    if (!j.contains("version") || j["version"] != kVersion) {
        return Error(fmt::format("'{}': parked VM record version {} is not supported",
                                 record_path(dir), j.contains("version") ? j["version"].dump()
                                                                         : "(none)"));
    }
    if (auto e = qapi_check(j, kParkedVmRecord, "", "")) {
        return Error(fmt::format("'{}': {}", record_path(dir), e->desc));
    }
    auto vm = parse_members(dir, j);
    QMIGD_TRY(vm);
    if (vm->blocks.empty() || vm->machine_type.empty() ||
        vm->machine_type.size() > kMaxMachineTypeName) {
        return Error(fmt::format("'{}' names no RAM block or no machine type",
                                 record_path(dir)));
    }
    return vm;
}

} // namespace

Result<ParkedVm> parked_vm_parse(const std::string &dir, const std::string &text)
{
    return parse_record(dir, text);
}

Status park_file_write(const std::string &path, const std::string &tmp_suffix,
                       const void *data, size_t len)
{
    return write_file(path, data, len, tmp_suffix);
}

Result<std::string> park_file_read(const std::string &path, size_t max)
{
    return read_file(path, max);
}

std::string parked_block_file(size_t index, const std::string &idstr)
{
    // The index keeps names apart, so the idstr part may be cut to keep the
    // name within NAME_MAX for any idstr QEMU takes (up to 255 bytes).
    constexpr size_t kMaxIdPart = 200;
    std::string name = fmt::format("{:02}-", index);
    for (char c : idstr.substr(0, kMaxIdPart)) {
        bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
        name += ok ? c : '_';
    }
    return name + ".img";
}

std::string parked_block_path(const std::string &dir, size_t index, const std::string &idstr)
{
    return dir + "/" + parked_block_file(index, idstr);
}

// Writes, syncs, renames and removes a page-sized file the way a park
// writes its small files, before any VM is taken: a file system that
// refuses them (hugetlbfs has no write()) must say so now, not after the
// whole transfer, when the source may have let its VM go.
static Status park_dir_probe(const std::string &dir)
{
    const std::string path = dir + "/.qmigd-write-check";
    std::vector<uint8_t> page(TARGET_PAGE_SIZE, 0x5a);
    Status st = write_file(path, page.data(), page.size());
    ::unlink(path.c_str());
    if (!st) {
        return Error(st.error()).prepend(
            fmt::format("'{}' cannot hold a parked VM (its files are written with write()): ",
                        dir));
    }
    return parked_dir_sync(dir);
}

Status park_dir_check(const std::string &dir)
{
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 && errno == ENOENT) {
        // A new directory for it (private: the images are the guest's RAM).
        if (::mkdir(dir.c_str(), 0700) != 0) {
            return Error(fmt::format("'{}' does not exist and cannot be created: {}", dir,
                                     std::strerror(errno)));
        }
        spdlog::info("created {} to park the VM in", dir);
    }
    if (::stat(dir.c_str(), &st) != 0) {
        return Error(fmt::format("'{}': {}", dir, std::strerror(errno)));
    }
    if (!S_ISDIR(st.st_mode)) {
        return Error(fmt::format("'{}' is not a directory", dir));
    }
    QMIGD_TRY(park_dir_unclaimed(dir));
    return park_dir_probe(dir);
}

Status park_dir_unclaimed(const std::string &dir)
{
    struct stat st;
    if (::lstat(record_path(dir).c_str(), &st) == 0) {
        return Error(fmt::format("'{}' already holds a parked VM", dir));
    }
    return {};
}

Result<UniqueFd> park_dir_lock(const std::string &dir)
{
    UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) {
        return file_error("Could not open", dir, errno);
    }
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) {
            return Error(fmt::format("'{}' is being parked into by another migration", dir));
        }
        return file_error("Could not lock", dir, errno);
    }
    return fd;
}

Status parked_dir_sync(const std::string &dir)
{
    UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd) {
        return file_error("Could not open", dir, errno);
    }
    if (::fsync(fd.get()) != 0) {
        return file_error("Could not sync", dir, errno);
    }
    return {};
}

namespace {

std::string record_text(const ParkedVm &vm)
{
    nlohmann::json j = {{"format", kParkedVmFormat},
                        {"version", kVersion},
                        {"ram-section-id", vm.ram_section_id},
                        {"device-state-bytes", vm.device_state.size()}};
    put_name(j, "machine-type", vm.machine_type);
    if (vm.uuid) {
        j["uuid"] = uuid_to_string(*vm.uuid);
    }
    if (!vm.iterable_state.empty()) {
        j["iterable-state-bytes"] = vm.iterable_state.size();
    }
    j["blocks"] = nlohmann::json::array();
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        const ParkedBlock &b = vm.blocks[i];
        json block = {{"size", b.size}, {"file", parked_block_file(i, b.idstr)}};
        put_name(block, "idstr", b.idstr);
        j["blocks"].push_back(std::move(block));
    }
    // put_name() left only UTF-8 in it: replace never has to act.
    return j.dump(1, ' ', false, json::error_handler_t::replace) + "\n";
}

bool same_record(const ParkedVm &a, const ParkedVm &b)
{
    if (a.machine_type != b.machine_type || a.blocks.size() != b.blocks.size()) {
        return false;
    }
    for (size_t i = 0; i < a.blocks.size(); i++) {
        if (a.blocks[i].idstr != b.blocks[i].idstr || a.blocks[i].size != b.blocks[i].size) {
            return false;
        }
    }
    return true;
}

} // namespace

Status parked_vm_write(const ParkedVm &vm)
{
    // The writer keeps to what the reader takes: a record it would refuse
    // (no blocks, a name it cannot hold) is never published.
    std::string text = record_text(vm);
    if (auto back = parse_record(vm.dir, text); !back || !same_record(*back, vm)) {
        return Error(fmt::format("qmigd cannot keep this VM in '{}': {}", vm.dir,
                                 back ? "its record does not read back the same"
                                      : back.error().message()));
    }
    if (!vm.iterable_state.empty()) {
        QMIGD_TRY(write_file(iterable_state_path(vm.dir), vm.iterable_state.data(),
                             vm.iterable_state.size()));
    }
    QMIGD_TRY(write_file(device_state_path(vm.dir), vm.device_state.data(),
                         vm.device_state.size()));
    // The images' and the device state's names are durable before the
    // record that points at them can be.
    QMIGD_TRY(parked_dir_sync(vm.dir));
    QMIGD_TRY(write_file(record_path(vm.dir), text.data(), text.size()));
    return parked_dir_sync(vm.dir);
}


// iterable-state.bin, when the record names one: of the size it says, and
// whole sections only.
static Status read_iterable_state(ParkedVm &vm)
{
    size_t recorded = vm.iterable_state.size();
    if (recorded == 0) {
        return {};
    }
    auto bytes = read_file(iterable_state_path(vm.dir), kMaxIterableState);
    QMIGD_TRY(bytes);
    vm.iterable_state.assign(bytes->begin(), bytes->end());
    if (vm.iterable_state.size() != recorded) {
        return Error(fmt::format("parked VM '{}': iterable state is {} bytes, the record says {}",
                                 vm.dir, vm.iterable_state.size(), recorded));
    }
    auto split = iterable_state_split(vm.iterable_state);
    if (!split) {
        return Error(split.error()).prepend(fmt::format("parked VM '{}': ", vm.dir));
    }
    return {};
}

Result<ParkedVm> parked_vm_read(const std::string &dir)
{
    auto text = read_file(record_path(dir), 1 << 20);
    QMIGD_TRY(text);
    auto vm = parse_record(dir, *text);
    QMIGD_TRY(vm);
    for (size_t i = 0; i < vm->blocks.size(); i++) {
        std::string path = parked_block_path(dir, i, vm->blocks[i].idstr);
        struct stat st;
        if (::lstat(path.c_str(), &st) != 0) {
            return Error(fmt::format("parked VM '{}': RAM image '{}': {}", dir, path,
                                     std::strerror(errno)));
        }
        if (!S_ISREG(st.st_mode)) {
            return Error(fmt::format("parked VM '{}': RAM image '{}' is not a regular file",
                                     dir, path));
        }
        if (uint64_t(st.st_size) != vm->blocks[i].size) {
            return Error(fmt::format("parked VM '{}': RAM image '{}' is {} bytes, the record "
                                     "says {}",
                                     dir, path, st.st_size, vm->blocks[i].size));
        }
    }
    uint64_t recorded = vm->device_state_bytes;
    auto ds = read_file(device_state_path(dir), kMaxDeviceState);
    QMIGD_TRY(ds);
    vm->device_state.assign(ds->begin(), ds->end());
    vm->device_state_bytes = vm->device_state.size();
    auto info = device_state_check(vm->device_state);
    if (!info) {
        return Error(info.error()).prepend(fmt::format("parked VM '{}': ", dir));
    }
    vm->device_sections_bytes = info->sections_bytes;
    if (recorded && recorded != vm->device_state_bytes) {
        return Error(fmt::format("parked VM '{}': device state is {} bytes, the record says {}",
                                 dir, vm->device_state_bytes, recorded));
    }
    QMIGD_TRY(read_iterable_state(*vm));
    return vm;
}

std::vector<RamBlockSpec> parked_vm_ram_specs(const ParkedVm &vm)
{
    std::vector<RamBlockSpec> specs;
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        RamBlockSpec s;
        s.name = vm.blocks[i].idstr;
        s.path = parked_block_path(vm.dir, i, vm.blocks[i].idstr);
        s.size = vm.blocks[i].size;
        s.open = ImageOpen::ReadOnly;
        specs.push_back(std::move(s));
    }
    return specs;
}

} // namespace qmigd
