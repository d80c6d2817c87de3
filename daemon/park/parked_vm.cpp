#include "daemon/park/parked_vm.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "protocol/device_state.h"

namespace qmigd {

namespace {

constexpr const char *kFormat = "qmigd-parked-vm";
constexpr int kVersion = 1;

std::string record_path(const std::string &dir) { return dir + "/vm.json"; }
std::string device_state_path(const std::string &dir) { return dir + "/device-state.bin"; }

// Through a temporary name, so that a reader sees the old file or the
// whole new one.
Status write_file(const std::string &path, const void *data, size_t len)
{
    std::string tmp = path + ".tmp";
    FILE *f = std::fopen(tmp.c_str(), "wbx");
    if (!f) {
        return Error(fmt::format("Could not create '{}': {}", tmp, std::strerror(errno)));
    }
    bool ok = std::fwrite(data, 1, len, f) == len;
    ok = std::fflush(f) == 0 && ok;
    int err = errno;
    std::fclose(f);
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
        err = ok ? errno : err;
        std::remove(tmp.c_str());
        return Error(fmt::format("Could not write '{}': {}", path, std::strerror(err)));
    }
    return {};
}

Result<std::string> read_file(const std::string &path, size_t max)
{
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        return Error(fmt::format("Could not open '{}': {}", path, std::strerror(errno)));
    }
    std::ostringstream s;
    s << in.rdbuf();
    if (s.str().size() > max) {
        return Error(fmt::format("'{}' is larger than {} bytes", path, max));
    }
    return s.str();
}

Result<ParkedVm> parse_record(const std::string &dir, const std::string &text)
{
    using nlohmann::json;
    json j = json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || j.value("format", "") != kFormat) {
        return Error(fmt::format("'{}' is not a parked VM record", record_path(dir)));
    }
    if (j.value("version", 0) != kVersion) {
        return Error(fmt::format("'{}': parked VM record version {} is not supported",
                                 record_path(dir), j.value("version", 0)));
    }
    ParkedVm vm;
    vm.dir = dir;
    try {
        vm.machine_type = j.at("machine-type").get<std::string>();
        vm.ram_section_id = j.at("ram-section-id").get<uint32_t>();
        if (j.contains("uuid")) {
            Uuid u;
            if (!uuid_parse(j["uuid"].get<std::string>(), &u)) {
                return Error("bad uuid");
            }
            vm.uuid = u;
        }
        for (const auto &b : j.at("blocks")) {
            vm.blocks.push_back({b.at("idstr").get<std::string>(), b.at("size").get<uint64_t>()});
        }
    } catch (const json::exception &e) {
        return Error(fmt::format("'{}': {}", record_path(dir), e.what()));
    }
    if (vm.blocks.empty() || vm.machine_type.empty() || vm.machine_type.size() > 255) {
        return Error(fmt::format("'{}' names no RAM block or no machine type",
                                 record_path(dir)));
    }
    return vm;
}

} // namespace

std::string parked_block_file(size_t index, const std::string &idstr)
{
    std::string name = fmt::format("{:02}-", index);
    for (char c : idstr) {
        bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
        name += ok ? c : '_';
    }
    return name + ".img";
}

std::string parked_block_path(const std::string &dir, size_t index, const std::string &idstr)
{
    return dir + "/" + parked_block_file(index, idstr);
}

Status park_dir_check(const std::string &dir)
{
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        return Error(fmt::format("'{}' is not a directory", dir));
    }
    if (::stat(record_path(dir).c_str(), &st) == 0) {
        return Error(fmt::format("'{}' already holds a parked VM", dir));
    }
    return {};
}

Status parked_vm_write(const ParkedVm &vm)
{
    QMIGD_TRY(write_file(device_state_path(vm.dir), vm.device_state.data(),
                         vm.device_state.size()));
    nlohmann::json j = {{"format", kFormat},
                        {"version", kVersion},
                        {"machine-type", vm.machine_type},
                        {"ram-section-id", vm.ram_section_id},
                        {"device-state-bytes", vm.device_state.size()}};
    if (vm.uuid) {
        j["uuid"] = uuid_to_string(*vm.uuid);
    }
    j["blocks"] = nlohmann::json::array();
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        const ParkedBlock &b = vm.blocks[i];
        j["blocks"].push_back({{"idstr", b.idstr},
                               {"size", b.size},
                               {"file", parked_block_file(i, b.idstr)}});
    }
    std::string text = j.dump(1) + "\n";
    return write_file(record_path(vm.dir), text.data(), text.size());
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
        if (::stat(path.c_str(), &st) != 0) {
            return Error(fmt::format("parked VM '{}': RAM image '{}': {}", dir, path,
                                     std::strerror(errno)));
        }
        if (uint64_t(st.st_size) != vm->blocks[i].size) {
            return Error(fmt::format("parked VM '{}': RAM image '{}' is {} bytes, the record "
                                     "says {}",
                                     dir, path, st.st_size, vm->blocks[i].size));
        }
    }
    auto ds = read_file(device_state_path(dir), kMaxDeviceState);
    QMIGD_TRY(ds);
    vm->device_state.assign(ds->begin(), ds->end());
    vm->device_state_bytes = vm->device_state.size();
    if (Status st = device_state_check(vm->device_state).status(); !st) {
        return Error(st.error()).prepend(fmt::format("parked VM '{}': ", dir));
    }
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
        specs.push_back(std::move(s));
    }
    return specs;
}

} // namespace qmigd
