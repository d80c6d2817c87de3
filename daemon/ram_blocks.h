// The RAMBlocks a daemon serves, from --ram NAME=FILE[,size=BYTES][,dirty=PATH].
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "protocol/error.h"
#include "protocol/qemu_format.h"
#include "ramstate/dirty_bitmap.h"
#include "ramstate/ram_image.h"

namespace qmigd {

struct RAMBlock {
    RamBlockDesc desc; // idstr + used_length, fixed once opened
    std::unique_ptr<RamImage> image;
    std::unique_ptr<DirtyBitmap> dirty; // source and guest roles only
};

struct RamBlockSpec {
    std::string name;
    std::string path;
    uint64_t size = 0;
    uint64_t addr = 0; // RamBlockDesc::addr (x-ignore-shared)
    std::string dirty_path; // default: side_file_path(path, backing, ".dirty")
    // ReadOnly (a parked VM's image): its dirty bitmap is anonymous and
    // nothing is written beside it, so a read-only checkpoint serves.
    ImageOpen open = ImageOpen::Shared;
};

Result<RamBlockSpec> ram_block_spec_parse(const std::string &text);
// Opens the image, picks its page path (`mode`, see ramstate/page_path.h)
// and logs the choice.
Result<RAMBlock> ram_block_open(const RamBlockSpec &spec, bool with_dirty_bitmap,
                                PagePathMode mode = PagePathMode::Auto);
// Opens every --ram; fails on the first bad one or on a duplicate name.
Result<std::vector<RAMBlock>> ram_blocks_open(const std::vector<std::string> &specs,
                                              bool with_dirty_bitmap,
                                              PagePathMode mode = PagePathMode::Auto);
// Removes the image files these blocks' opens created: a start that fails
// after opening them leaves no file it made behind.
void ram_blocks_remove_created(const std::vector<RAMBlock> &blocks);
std::vector<RamBlockDesc> ram_block_descs(const std::vector<RAMBlock> &blocks);
// QEMU's size syntax (monitor/qemu_size.h): 123, 4K, 1.5M, 0x100000; binary units.
bool parse_size(const std::string &text, uint64_t *out);

} // namespace qmigd
