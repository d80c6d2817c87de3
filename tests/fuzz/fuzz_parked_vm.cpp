// libFuzzer target: vm.json, a parked VM's record, from a directory that
// is input. Whatever the text, parsing returns a record or an error; a
// record it returns names 1..N blocks of whole pages with idstrs of 1..255
// bytes and a machine type of 1..256 bytes (QEMU's and the loader's bound).
#include <cstdint>
#include <string>

#include "daemon/park/parked_vm.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    std::string text(reinterpret_cast<const char *>(data), size);
    auto vm = parked_vm_parse("/parked", text);
    if (!vm.ok()) {
        return 0;
    }
    if (vm->blocks.empty() || vm->machine_type.empty() || vm->machine_type.size() > 256) {
        __builtin_trap();
    }
    for (size_t i = 0; i < vm->blocks.size(); i++) {
        const ParkedBlock &b = vm->blocks[i];
        if (b.idstr.empty() || b.idstr.size() > 255 || b.size == 0 || b.size % 4096) {
            __builtin_trap();
        }
        if (parked_block_file(i, b.idstr).size() > 255) {
            __builtin_trap(); // a file name past NAME_MAX
        }
    }
    return 0;
}
