// --ram NAME=FILE[,size=,dirty=]: parsing the option and opening each block's image.
#include "daemon/ram_blocks.h"

#include <unistd.h>

#include <sstream>

#include <spdlog/spdlog.h>

#include "monitor/qemu_size.h"

namespace qmigd {

bool parse_size(const std::string &text, uint64_t *out)
{
    auto v = qemu_strtosz(text, 0);
    if (v) {
        *out = *v;
    }
    return v.has_value();
}

namespace {
// QEMU says only "expects a size value"; the forms it takes, said once.
const char *const kSizeForms = " (bytes, or with a unit: 256M, 1.5G, 0x10000000)";
} // namespace

Result<RamBlockSpec> ram_block_spec_parse(const std::string &text)
{
    RamBlockSpec spec;
    std::stringstream ss(text);
    std::string part;
    bool first = true;
    while (std::getline(ss, part, ',')) {
        size_t eq = part.find('=');
        if (eq == std::string::npos) {
            return Error("--ram '" + text + "': expected NAME=FILE[,size=BYTES][,dirty=PATH][,addr=GPA]");
        }
        std::string key = part.substr(0, eq), val = part.substr(eq + 1);
        if (first) {
            spec.name = key;
            spec.path = val;
            first = false;
        } else if (key == "size") {
            if (!parse_size(val, &spec.size)) {
                return Error("--ram '" + text + "': Parameter 'size' expects a size value" + kSizeForms);
            }
        } else if (key == "dirty") {
            spec.dirty_path = val;
        } else if (key == "addr") {
            if (!parse_size(val, &spec.addr)) {
                return Error("--ram '" + text + "': Parameter 'addr' expects a number" + kSizeForms);
            }
        } else {
            return Error("--ram '" + text + "': unknown option '" + key + "'");
        }
    }
    if (spec.name.empty() || spec.name.size() > 255 || spec.path.empty()) {
        return Error("--ram '" + text + "': expected NAME=FILE (name of 1 to 255 bytes)");
    }
    return spec;
}

namespace {

std::string parent_dir(const std::string &path)
{
    size_t slash = path.rfind('/');
    return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

} // namespace

Result<RAMBlock> ram_block_open(const RamBlockSpec &spec, bool with_dirty_bitmap,
                                PagePathMode mode)
{
    RAMBlock b;
    auto img = RamImage::open(spec.path, spec.size, spec.open);
    QMIGD_TRY(img);
    b.image = std::move(*img);
    const Backing &backing = b.image->backing();
    b.desc = RamBlockDesc{spec.name, b.image->size(),
                          backing.kind == BackingKind::Hugetlbfs ? backing.page_size
                                                                 : TARGET_PAGE_SIZE,
                          spec.addr};
    bool read_only = spec.open == ImageOpen::ReadOnly;
    // Measuring needs a scratch file beside the image: not in a parked VM's
    // directory. A parked image on 4 KiB tmpfs is measured in /dev/shm (the
    // same shmem, the same costs); on a disk, pages are read with pread,
    // page cache to buffer, where a mapping would fault on each of them.
    std::string measure_in = parent_dir(spec.path);
    PagePathMode how = mode;
    if (read_only && mode == PagePathMode::Auto) {
        if (b.image->backing().kind == BackingKind::Tmpfs) {
            measure_in = "/dev/shm";
        } else if (b.image->backing().kind == BackingKind::Other) {
            how = PagePathMode::File;
        }
    }
    // A source (it keeps a dirty bitmap) never writes its image.
    PagePaths paths =
        choose_page_paths(measure_in, b.image->backing(), how, !with_dirty_bitmap && !read_only);
    b.image->set_page_paths(paths);
    spdlog::info("RAM block '{}': {} on {}; page path {}", spec.name, spec.path,
                 b.image->backing().name(), b.image->page_paths().why);
    if (with_dirty_bitmap) {
        SideFile dirty = read_only ? SideFile{"", SideFileName::Anonymous}
                                   : side_file(spec.dirty_path, spec.path, b.image->backing(),
                                               ".dirty");
        if (dirty.name == SideFileName::Derived && dirty.path != spec.path + ".dirty") {
            spdlog::info("RAM block '{}': dirty bitmap in {} ({} holds no small files)",
                         spec.name, dirty.path, b.image->backing().name());
        }
        auto bm = DirtyBitmap::open(dirty.path, b.image->pages(), dirty.name);
        if (!bm) {
            if (b.image->created()) {
                ::unlink(b.image->path().c_str());
            }
            return bm.error();
        }
        b.dirty = std::move(*bm);
    }
    return b;
}

namespace {

// Appends each spec's block to `blocks`, in order, until one fails.
Status open_each(const std::vector<std::string> &specs, bool with_dirty_bitmap,
                 PagePathMode mode, std::vector<RAMBlock> &blocks)
{
    for (const auto &text : specs) {
        auto spec = ram_block_spec_parse(text);
        QMIGD_TRY(spec);
        for (const auto &b : blocks) {
            if (b.desc.idstr == spec->name) {
                return Error("--ram: duplicate RAM block name '" + spec->name + "'");
            }
        }
        auto b = ram_block_open(*spec, with_dirty_bitmap, mode);
        QMIGD_TRY(b);
        blocks.push_back(std::move(*b));
    }
    return {};
}

} // namespace

Result<std::vector<RAMBlock>> ram_blocks_open(const std::vector<std::string> &specs,
                                              bool with_dirty_bitmap, PagePathMode mode)
{
    std::vector<RAMBlock> blocks;
    if (Status st = open_each(specs, with_dirty_bitmap, mode, blocks); !st) {
        ram_blocks_remove_created(blocks); // the blocks opened before the one that failed
        return st.error();
    }
    return blocks;
}

void ram_blocks_remove_created(const std::vector<RAMBlock> &blocks)
{
    for (const auto &b : blocks) {
        if (b.image && b.image->created()) {
            ::unlink(b.image->path().c_str());
        }
    }
}

std::vector<RamBlockDesc> ram_block_descs(const std::vector<RAMBlock> &blocks)
{
    std::vector<RamBlockDesc> d;
    for (const auto &b : blocks) {
        d.push_back(b.desc);
    }
    return d;
}

} // namespace qmigd
