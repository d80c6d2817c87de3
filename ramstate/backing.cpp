// What backs an image file (tmpfs, huge-page tmpfs, hugetlbfs, disk), learnt from the file system.
#include "ramstate/backing.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>

#include <fmt/format.h>

namespace qmigd {

namespace {

constexpr long kTmpfsMagic = 0x01021994;
constexpr long kHugetlbfsMagic = 0x958458f6;

// The super options (last field) of the mount that holds device `dev`.
std::string mount_options(dev_t dev)
{
    std::ifstream in("/proc/self/mountinfo");
    std::string line;
    std::string want = fmt::format("{}:{}", major(dev), minor(dev));
    while (std::getline(in, line)) {
        std::istringstream ss(line);
        std::string id, parent, devno;
        ss >> id >> parent >> devno;
        if (devno != want) {
            continue;
        }
        size_t dash = line.find(" - ");
        if (dash == std::string::npos) {
            continue;
        }
        std::istringstream rest(line.substr(dash + 3));
        std::string fstype, source, opts;
        rest >> fstype >> source >> opts;
        return opts;
    }
    return {};
}

bool has_option(const std::string &opts, const std::string &opt)
{
    std::string padded = "," + opts + ",";
    return padded.find("," + opt + ",") != std::string::npos;
}

} // namespace

std::string Backing::name() const
{
    switch (kind) {
    case BackingKind::Tmpfs:
        return "tmpfs (4 KiB pages)";
    case BackingKind::TmpfsHuge:
        return fmt::format("tmpfs huge pages ({} KiB)", page_size >> 10);
    case BackingKind::Hugetlbfs:
        return fmt::format("hugetlbfs ({} KiB pages)", page_size >> 10);
    case BackingKind::Other:
        break;
    }
    return "disk file system";
}

Result<Backing> backing_of(int fd, const std::string &path)
{
    struct statfs fs;
    struct stat st;
    if (fstatfs(fd, &fs) < 0 || fstat(fd, &st) < 0) {
        return Error(fmt::format("cannot stat file system of '{}': {}", path, std::strerror(errno)));
    }
    Backing b;
    if (fs.f_type == kHugetlbfsMagic) {
        b.kind = BackingKind::Hugetlbfs;
        b.page_size = uint64_t(fs.f_bsize);
    } else if (fs.f_type == kTmpfsMagic) {
        std::string opts = mount_options(st.st_dev);
        bool huge = has_option(opts, "huge=always") || has_option(opts, "huge=within_size");
        b.kind = huge ? BackingKind::TmpfsHuge : BackingKind::Tmpfs;
        b.page_size = huge ? 2u << 20 : 4096;
    }
    return b;
}

std::string side_file_path(const std::string &image, const Backing &b, const char *suffix)
{
    if (b.kind != BackingKind::Hugetlbfs) {
        return image + suffix;
    }
    std::string name = image;
    for (char &c : name) {
        c = c == '/' ? '_' : c;
    }
    return "/dev/shm/qmigd" + name + suffix;
}

SideFile side_file(const std::string &named, const std::string &image, const Backing &b,
                   const char *suffix)
{
    if (!named.empty()) {
        return {named, SideFileName::Named};
    }
    return {side_file_path(image, b, suffix), SideFileName::Derived};
}

} // namespace qmigd
