// A parked VM's working set (DIR/working-set.bin): encoded, checked, written and read back.
#include "daemon/park/working_set.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "protocol/qemu_format.h"
#include "protocol/wire.h"

namespace qmigd {

namespace {

constexpr char kWorkingSetMagic[8] = {'Q', 'M', 'I', 'G', 'D', '-', 'W', 'S'};
constexpr uint32_t kWorkingSetVersion = 1;
constexpr size_t kWorkingSetMaxBlocks = 256;
constexpr size_t kRangeBytes = 2 + 8 + 4;
// The largest file the limits allow, and a little more: a bigger one is
// not read at all.
constexpr size_t kWorkingSetMaxBytes =
    16 + kWorkingSetMaxBlocks * (1 + 255 + 8) + 4 + kWorkingSetMaxRanges * kRangeBytes;

void put_be(std::vector<uint8_t> &out, uint64_t v, int bytes)
{
    for (int i = bytes - 1; i >= 0; i--) {
        out.push_back(uint8_t(v >> (8 * i)));
    }
}

// Reads big-endian fields of an untrusted buffer: a read past its end
// sets `short_` and yields zeros, checked once at each step's end.
class WsReader {
public:
    explicit WsReader(std::span<const uint8_t> b) : b_(b) {}
    uint64_t be(int bytes)
    {
        if (left() < size_t(bytes)) {
            short_ = true;
            pos_ = b_.size();
            return 0;
        }
        uint64_t v = 0;
        for (int i = 0; i < bytes; i++) {
            v = (v << 8) | b_[pos_++];
        }
        return v;
    }
    std::string text(size_t n)
    {
        if (left() < n) {
            short_ = true;
            pos_ = b_.size();
            return {};
        }
        std::string s(reinterpret_cast<const char *>(b_.data() + pos_), n);
        pos_ += n;
        return s;
    }
    size_t left() const { return b_.size() - pos_; }
    bool truncated() const { return short_; }

private:
    std::span<const uint8_t> b_;
    size_t pos_ = 0;
    bool short_ = false;
};

Error ws_error(const std::string &why) { return Error(why); }

// The record's block table, as indices into the VM's blocks: each named
// block must be the VM's, of the same size.
Result<std::vector<size_t>> decode_blocks(WsReader &r, const std::vector<ParkedBlock> &blocks)
{
    uint64_t n = r.be(4);
    if (n == 0 || n > kWorkingSetMaxBlocks) {
        return ws_error(fmt::format("{} blocks (1 to {})", n, kWorkingSetMaxBlocks));
    }
    std::vector<size_t> map;
    for (uint64_t i = 0; i < n; i++) {
        size_t len = size_t(r.be(1));
        std::string idstr = r.text(len);
        uint64_t size = r.be(8);
        if (r.truncated()) {
            return ws_error("truncated in its block list");
        }
        size_t j = 0;
        while (j < blocks.size() && blocks[j].idstr != idstr) {
            j++;
        }
        if (len == 0 || j == blocks.size()) {
            return ws_error(fmt::format("the VM has no block '{}'", wire_text(idstr)));
        }
        if (blocks[j].size != size) {
            return ws_error(fmt::format("block '{}' is {} bytes, not {}", wire_text(idstr),
                                        blocks[j].size, size));
        }
        map.push_back(j);
    }
    return map;
}

Status check_range(const WorkingSetRange &w, const ParkedBlock &b)
{
    uint64_t block_pages = b.size / TARGET_PAGE_SIZE;
    uint64_t first = w.offset / TARGET_PAGE_SIZE;
    if (w.offset % TARGET_PAGE_SIZE || w.pages == 0 || first >= block_pages ||
        w.pages > block_pages - first) {
        return ws_error(fmt::format("range {:#x}+{} pages is not inside block '{}' ({} bytes)",
                                    w.offset, w.pages, wire_text(b.idstr), b.size));
    }
    return {};
}

constexpr const char *kWorkingSetFile = "working-set.bin";

} // namespace

std::string working_set_path(const std::string &dir) { return dir + "/" + kWorkingSetFile; }

uint64_t working_set_pages(const std::vector<WorkingSetRange> &ranges)
{
    uint64_t n = 0;
    for (const auto &r : ranges) {
        n += r.pages;
    }
    return n;
}

std::vector<uint8_t> working_set_encode(const std::vector<ParkedBlock> &blocks,
                                        const std::vector<WorkingSetRange> &ranges)
{
    std::vector<uint8_t> out(std::begin(kWorkingSetMagic), std::end(kWorkingSetMagic));
    put_be(out, kWorkingSetVersion, 4);
    put_be(out, blocks.size(), 4);
    for (const auto &b : blocks) {
        put_be(out, b.idstr.size(), 1);
        out.insert(out.end(), b.idstr.begin(), b.idstr.end());
        put_be(out, b.size, 8);
    }
    put_be(out, ranges.size(), 4);
    for (const auto &r : ranges) {
        put_be(out, r.block, 2);
        put_be(out, r.offset, 8);
        put_be(out, r.pages, 4);
    }
    return out;
}

Result<std::vector<WorkingSetRange>> working_set_decode(std::span<const uint8_t> bytes,
                                                        const std::vector<ParkedBlock> &blocks)
{
    WsReader r(bytes);
    std::string magic = r.text(sizeof(kWorkingSetMagic));
    uint64_t version = r.be(4);
    if (r.truncated() || std::memcmp(magic.data(), kWorkingSetMagic, magic.size()) != 0) {
        return ws_error("not a working set file");
    }
    if (version != kWorkingSetVersion) {
        return ws_error(fmt::format("version {} (this qmigd reads {})", version,
                                    kWorkingSetVersion));
    }
    auto map = decode_blocks(r, blocks);
    QMIGD_TRY(map);
    uint64_t n = r.be(4);
    if (r.truncated()) {
        return ws_error("truncated before its ranges");
    }
    // The count is checked against what is left before anything is kept.
    if (n > kWorkingSetMaxRanges || r.left() != n * kRangeBytes) {
        return ws_error(fmt::format("{} ranges in {} bytes", n, r.left()));
    }
    std::vector<WorkingSetRange> ranges;
    ranges.reserve(size_t(n));
    uint64_t pages = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t index = r.be(2);
        WorkingSetRange w{0, r.be(8), r.be(4)};
        if (index >= map->size()) {
            return ws_error(fmt::format("range {} names block {} of {}", i, index, map->size()));
        }
        w.block = (*map)[size_t(index)];
        QMIGD_TRY(check_range(w, blocks[w.block]));
        pages += w.pages;
        if (pages > kWorkingSetMaxPages) {
            return ws_error(fmt::format("more than {} pages", kWorkingSetMaxPages));
        }
        ranges.push_back(w);
    }
    return ranges;
}

Result<std::vector<WorkingSetRange>> working_set_read(const ParkedVm &vm)
{
    const std::string path = working_set_path(vm.dir);
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT) {
        return std::vector<WorkingSetRange>{};
    }
    auto text = park_file_read(path, kWorkingSetMaxBytes);
    QMIGD_TRY(text);
    auto ranges = working_set_decode(
        std::span(reinterpret_cast<const uint8_t *>(text->data()), text->size()), vm.blocks);
    if (!ranges) {
        return Error(ranges.error()).prepend(fmt::format("'{}': ", path));
    }
    return ranges;
}

namespace {

// Removes the temporary files of earlier writes whose process is gone (one
// killed between its write and its rename): their names carry the writer's
// pid, so no later write would reuse and replace them, and on a tmpfs each
// holds memory. A live writer's file (another resume of this directory,
// this process's own) is left alone.
void remove_stale_temporaries(const std::string &dir)
{
    const std::string prefix = std::string(kWorkingSetFile) + ".tmp.";
    DIR *d = ::opendir(dir.c_str());
    if (!d) {
        return;
    }
    while (struct dirent *e = ::readdir(d)) {
        std::string name = e->d_name;
        if (name.compare(0, prefix.size(), prefix) != 0) {
            continue;
        }
        char *end = nullptr;
        long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
        if (pid <= 0 || *end != '.' || pid == ::getpid() ||
            ::kill(pid_t(pid), 0) == 0 || errno != ESRCH) {
            continue;
        }
        if (::unlinkat(::dirfd(d), e->d_name, 0) == 0) {
            spdlog::info("migration: removed '{}/{}', left by a resume that ended while "
                         "writing its working set", dir, name);
        }
    }
    ::closedir(d);
}

} // namespace

Status working_set_write(const ParkedVm &vm, const std::vector<WorkingSetRange> &ranges)
{
    remove_stale_temporaries(vm.dir);
    std::vector<uint8_t> bytes = working_set_encode(vm.blocks, ranges);
    // What would not read back is never published.
    if (auto back = working_set_decode(bytes, vm.blocks); !back) {
        return back.error();
    }
    // A temporary name of this process's and this write's own: another
    // resume of the directory may be writing its own at the same time.
    static std::atomic<unsigned> writes{0};
    std::string suffix = fmt::format(".tmp.{}.{}", ::getpid(), writes++);
    QMIGD_TRY(park_file_write(working_set_path(vm.dir), suffix, bytes.data(), bytes.size()));
    return parked_dir_sync(vm.dir);
}

} // namespace qmigd
