// Which way page data moves between a RAM image and the network, chosen
// per image by measuring this machine.
//
// Two ways exist in each direction, and which is cheaper depends on the
// machine and on the backing, by up to 10x either way (shared/perf has two
// machines; on one a first touch of a /dev/shm page through a mapping costs
// 2-22 us, on another 0.7 us; on huge pages it is one fault per 2 MiB):
//  - File:   source preads pages into a buffer, checks and sends them from
//            there; destination receives into a buffer and pwrites it.
//            Costs a kernel copy each way, no page-table work.
//  - Mapped: source checks pages in place and sends them straight from the
//            mapping (QEMU's way); destination pre-faults the range with
//            MADV_POPULATE_WRITE and receives straight into the mapping.
//            Costs page-table faults, no extra copy.
//  - Fill:   destination only, on shmem: receives into a buffer and makes
//            the new pages holding it (UFFDIO_COPY, ramstate/fill_mapping.h).
//            A kernel copy, no clearing, no inode lock.
// The rule: on huge pages (hugetlbfs, huge-page tmpfs) both sides map: one
// fault covers 512 pages, and pwrite would serialise the receive threads'
// huge-page allocations on the inode lock (hugetlbfs has no pwrite at all).
// Elsewhere each choice goes to the side measured cheaper per page on a
// scratch file next to the image (same file system), at start-up, in about
// 0.1 s. Writes are measured with one writer per core (up to 4) into the
// same file, as the receive threads write: pwrite serialises on the file's
// inode lock and faults and fills do not.
#pragma once

#include <cstdint>
#include <string>

#include "ramstate/backing.h"

namespace qmigd {

enum class PageAccess { File, Mapped, Fill };
// Fill forces the destination's writes only (reads stay File).
enum class PagePathMode { Auto, File, Mapped, Fill };

const char *page_access_name(PageAccess a);
bool page_path_mode_parse(const std::string &text, PagePathMode *out);

// Per 4 KiB page, in nanoseconds; negative where not measured.
struct PagePathCosts {
    double pread_ns = -1;     // pread into a buffer + zero check
    double map_read_ns = -1;  // fresh mapping: MADV_POPULATE_READ + zero check in place
    double pwrite_ns = -1;    // pwrite into a fresh file (wall clock, concurrent writers)
    double map_write_ns = -1; // fresh mapping: MADV_POPULATE_WRITE + copy in (same)
    double fill_ns = -1;      // UFFDIO_COPY into a fresh file (same; shmem only)
};

struct PagePaths {
    PageAccess read = PageAccess::File;  // source side
    PageAccess write = PageAccess::File; // destination side
    // What writes take where `write` is Fill and no fill mapping can be
    // had (RamImage::set_page_paths): the best of the other two.
    PageAccess write_without_fill = PageAccess::File;
    PagePathCosts costs;
    std::string why; // one line for the log
};

// Picks the paths for an image in directory `dir` on `backing`. Auto
// measures (once per directory and process; later calls reuse it); File and
// Mapped force both directions (hugetlbfs still writes through the mapping).
// `receives`: the image is a destination's, which pages are written into;
// only such an image takes the Fill path (it costs a second mapping and a
// userfaultfd).
PagePaths choose_page_paths(const std::string &dir, const Backing &backing, PagePathMode mode,
                            bool receives);

// The measurement alone, on scratch files of `bytes` in `dir`.
PagePathCosts measure_page_paths(const std::string &dir, const Backing &backing, size_t bytes);

} // namespace qmigd
