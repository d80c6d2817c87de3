// A parked VM: what a destination kept of a whole migration stream, in
// one directory, for a later QEMU (or qmigd) to be migrated to.
//
//   DIR/vm.json            the record: machine type, the ram section's id,
//                          the blocks in the order the source announced them
//                          (a name that is not UTF-8 as KEY-hex: its bytes)
//   DIR/NN-IDSTR.img       one RAM image per block (its bytes as QEMU maps
//                          them), IDSTR with anything but [A-Za-z0-9._-] as _
//   DIR/device-state.bin   every device section, QEMU_VM_EOF and the VM
//                          description, as they came (protocol/device_state.h)
//   DIR/iterable-state.bin the iterable sections that are not RAM's (block
//                          dirty bitmaps), when the stream had any
//                          (protocol/iterable_state.h)
//
// vm.json is written last, through a temporary name, after the images and
// the device state are on stable storage: a directory with a vm.json holds
// a whole parked VM, even after a crash, and nothing here overwrites one.
// Every file here is opened without following symbolic links, and read
// only if it is a regular file of a bounded size: the directory is input.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "daemon/io/unique_fd.h"
#include "daemon/ram_blocks.h"
#include "protocol/error.h"
#include "protocol/qemu_format.h"

namespace qmigd {

struct ParkedBlock {
    std::string idstr;
    uint64_t size = 0;
};

struct ParkedVm {
    std::string dir;
    std::string machine_type;
    std::optional<Uuid> uuid;
    uint32_t ram_section_id = 0;
    std::vector<ParkedBlock> blocks;
    std::vector<uint8_t> device_state;
    size_t device_state_bytes = 0; // its size, kept where the bytes are not
    // Of which the device sections, before QEMU_VM_EOF: what a postcopy
    // resume packages (set when the device state is read back).
    size_t device_sections_bytes = 0;
    // Iterable sections other than RAM's, framed (protocol/iterable_state.h);
    // empty for most VMs, and then no file is written.
    std::vector<uint8_t> iterable_state;
};

// NN-IDSTR.img for the index-th block, and the same in DIR.
std::string parked_block_file(size_t index, const std::string &idstr);
std::string parked_block_path(const std::string &dir, size_t index, const std::string &idstr);
// Where a VM may be parked: a directory with no parked VM in it, created
// (0700) when it does not exist yet, where a file can be written, synced
// and renamed as a park writes its own (hugetlbfs cannot).
Status park_dir_check(const std::string &dir);
// DIR claimed for one park (flock on the directory itself, released with
// the descriptor, a dead process's included): another park into it is
// refused while this one runs, so that no two parks delete or overwrite
// each other's files. Refused at once if another process holds it.
Result<UniqueFd> park_dir_lock(const std::string &dir);
// Still no parked VM in DIR (checked again as a park announces its blocks,
// before it deletes anything there: a directory can be parked into by a
// park that began after this one's check).
Status park_dir_unclaimed(const std::string &dir);
// Writes device-state.bin, then vm.json, each synced before its rename,
// syncing the directory after each. The images are in place and synced.
// Refuses, before writing anything, a VM whose record would not read back
// as it is (parked_vm_read() is the judge).
Status parked_vm_write(const ParkedVm &vm);
// A small file of the directory, as the park writes its own: through
// PATH + tmp_suffix, synced before the rename; the directory entry is the
// caller's to sync (parked_dir_sync()).
Status park_file_write(const std::string &path, const std::string &tmp_suffix,
                       const void *data, size_t len);
// A file of the directory, whole: a regular file of at most `max` bytes,
// never followed through a symbolic link, never a FIFO or device.
Result<std::string> park_file_read(const std::string &path, size_t max);
// fsync of the directory itself: the names in it are durable.
Status parked_dir_sync(const std::string &dir);
// vm.json's text as a record (no file is looked at): for the fuzzer.
Result<ParkedVm> parked_vm_parse(const std::string &dir, const std::string &text);
// Reads and checks a parked VM: the record, each image's size, and that
// the device state is whole. Writes nothing in the directory.
Result<ParkedVm> parked_vm_read(const std::string &dir);
// The --ram specs of its blocks (names are the blocks' idstrs), read-only.
std::vector<RamBlockSpec> parked_vm_ram_specs(const ParkedVm &vm);

} // namespace qmigd
