// What a RAM image file lives on, and what follows from it: the page size
// the kernel maps it with, whether pwrite works, whether holes can be found
// and punched 4 KiB at a time.
#pragma once

#include <cstdint>
#include <string>

#include "protocol/error.h"
#include "ramstate/shared_file.h"

namespace qmigd {

enum class BackingKind {
    Tmpfs,     // shmem with 4 KiB pages (/dev/shm)
    TmpfsHuge, // shmem mounted huge=always|within_size: 2 MiB folios
    Hugetlbfs, // hugetlbfs: fixed huge pages, no write(2), no SEEK_HOLE
    Other,     // a disk file system
};

struct Backing {
    BackingKind kind = BackingKind::Other;
    // Granule the kernel allocates and maps: 4096, or the huge page size.
    uint64_t page_size = 4096;

    // write(2)/pwrite(2) move data into it (not on hugetlbfs).
    bool can_pwrite() const { return kind != BackingKind::Hugetlbfs; }
    // UFFDIO_COPY can add 4 KiB pages to it (shmem; hugetlbfs would take
    // whole huge pages only).
    bool can_fill() const { return kind == BackingKind::Tmpfs || kind == BackingKind::TmpfsHuge; }
    // 4 KiB holes can be punched without splitting a huge page.
    bool punch_4k() const { return kind == BackingKind::Tmpfs || kind == BackingKind::Other; }
    // SEEK_HOLE/SEEK_DATA report never-written ranges.
    bool seeks_holes() const { return kind != BackingKind::Hugetlbfs; }
    std::string name() const;
};

// Looks at the file system under fd (statfs, and the mount's huge= option).
Result<Backing> backing_of(int fd, const std::string &path);

// Where a side file of an image goes (its dirty bitmap ".dirty", the guest
// control record ".ctl"): beside the image where its file system holds
// small files; on hugetlbfs (whole huge pages only) in /dev/shm, under a
// name derived from the image's path.
std::string side_file_path(const std::string &image, const Backing &b, const char *suffix);

// A side file as the user asked for it: `named` when given, else the
// derived path above; `name` says which (a derived one may be removed at
// exit, shared_file.h).
struct SideFile {
    std::string path;
    SideFileName name;
};
SideFile side_file(const std::string &named, const std::string &image, const Backing &b,
                   const char *suffix);

} // namespace qmigd
