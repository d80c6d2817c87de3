// libFuzzer target: a parked VM's record written by a destination
// (parked_vm_write) from what a stream may carry -- block names of 1..255
// bytes other than NUL, a machine type of 0..256 arbitrary bytes, any
// sizes, section id and UUID -- then read back as `qmigd source --ram-dir`
// does (parked_vm_read). Either the writer refuses, leaving no vm.json
// behind, or the reader gets the same VM back: a record written is a VM
// that can be resumed. Files go to a private directory in /dev/shm.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <fuzzer/FuzzedDataProvider.h>
#include <nlohmann/json.hpp>

#include "daemon/park/parked_vm.h"
#include "protocol/qemu_format.h"

using namespace qmigd;

namespace {

// A stream's names: cstr8 (what the loader takes for a block, and the
// configuration section's be32-counted machine type of at most 256 bytes).
std::string block_name(FuzzedDataProvider &in)
{
    std::string s = in.ConsumeRandomLengthString(255);
    for (char &c : s) {
        c = c ? c : '_';
    }
    return s.empty() ? "mem" : s;
}

// A whole device state as the loader keeps it: QEMU_VM_EOF, then the VM
// description of an empty JSON object.
const std::vector<uint8_t> kDeviceState = {QEMU_VM_EOF, QEMU_VM_VMDESCRIPTION, 0, 0, 0, 2,
                                           '{', '}'};

// Made once per process, removed at its exit (kept alive past the
// destructors of statics: the exit handler reads it).
const std::string &scratch_dir()
{
    static const std::string *dir = [] {
        auto *d = new std::string("/dev/shm/fuzz_vm_json_writer.XXXXXX");
        if (!::mkdtemp(d->data())) {
            std::abort();
        }
        std::atexit([] { std::system(("rm -rf " + scratch_dir()).c_str()); });
        return d;
    }();
    return *dir;
}

void empty_dir(const std::string &dir, const ParkedVm &vm)
{
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        ::unlink(parked_block_path(dir, i, vm.blocks[i].idstr).c_str());
    }
    for (const char *f : {"/vm.json", "/device-state.bin", "/iterable-state.bin"}) {
        ::unlink((dir + f).c_str());
    }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    FuzzedDataProvider in(data, size);
    ParkedVm vm;
    vm.dir = scratch_dir();
    vm.machine_type = in.ConsumeRandomLengthString(256);
    vm.ram_section_id = in.ConsumeIntegral<uint32_t>();
    if (in.ConsumeBool()) {
        Uuid u;
        in.ConsumeData(u.data(), u.size());
        vm.uuid = u;
    }
    size_t nblocks = in.ConsumeIntegralInRange<size_t>(1, 4);
    for (size_t i = 0; i < nblocks; i++) {
        uint64_t pages = in.ConsumeIntegralInRange<uint64_t>(1, 1ull << 40);
        vm.blocks.push_back({block_name(in), pages * TARGET_PAGE_SIZE});
    }
    vm.device_state = kDeviceState;
    // The images are in place (sparse) before the record, as a park makes them.
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        std::string path = parked_block_path(vm.dir, i, vm.blocks[i].idstr);
        int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 || ::ftruncate(fd, off_t(vm.blocks[i].size)) != 0) {
            std::abort(); // the scratch directory is broken, not the code
        }
        ::close(fd);
    }
    // QMIGD_FUZZ_SKIP_KNOWN=1: past the findings already reported (a
    // machine type of 0 or 256 bytes, names that are not UTF-8), for a
    // long run looking for others; their inputs are in the corpus.
    static const bool skip_known = std::getenv("QMIGD_FUZZ_SKIP_KNOWN") != nullptr;
    if (skip_known && (vm.machine_type.empty() || vm.machine_type.size() > 255)) {
        empty_dir(vm.dir, vm);
        return 0;
    }
    Status written;
    try {
        written = parked_vm_write(vm);
    } catch (const nlohmann::json::exception &) {
        if (!skip_known) {
            throw;
        }
        empty_dir(vm.dir, vm);
        return 0;
    }
    auto back = parked_vm_read(vm.dir);
    empty_dir(vm.dir, vm);
    if (!written.ok()) {
        if (back.ok()) {
            __builtin_trap(); // refused, yet a parked VM is left behind
        }
        return 0;
    }
    if (!back.ok()) {
        std::fprintf(stderr, "written but not read back: %s\n", back.error().message().c_str());
        __builtin_trap(); // a record that cannot be resumed: the VM is lost
    }
    if (back->machine_type != vm.machine_type || back->uuid != vm.uuid ||
        back->ram_section_id != vm.ram_section_id || back->blocks.size() != vm.blocks.size() ||
        back->device_state != vm.device_state) {
        __builtin_trap();
    }
    for (size_t i = 0; i < vm.blocks.size(); i++) {
        if (back->blocks[i].idstr != vm.blocks[i].idstr ||
            back->blocks[i].size != vm.blocks[i].size) {
            __builtin_trap();
        }
    }
    return 0;
}
