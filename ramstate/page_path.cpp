// The page-path measurement: pread against mapping, pwrite against mapping, per directory.
#include "ramstate/page_path.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <memory>
#include <mutex>
#include <sys/mman.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include "protocol/qemu_format.h"
#include "ramstate/fill_mapping.h"
#include "ramstate/populate.h"
#include "ramstate/scratch_file.h"
#include "ramstate/zero_page.h"


namespace qmigd {

const char *page_access_name(PageAccess a)
{
    return a == PageAccess::Mapped ? "mapped" : a == PageAccess::Fill ? "fill" : "file";
}

bool page_path_mode_parse(const std::string &text, PagePathMode *out)
{
    if (text == "auto") {
        *out = PagePathMode::Auto;
    } else if (text == "file") {
        *out = PagePathMode::File;
    } else if (text == "mapped") {
        *out = PagePathMode::Mapped;
    } else if (text == "fill") {
        *out = PagePathMode::Fill;
    } else {
        return false;
    }
    return true;
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kChunk = 512 * 1024; // one multifd packet of pages

double ns_per_page(Clock::time_point t0, size_t bytes)
{
    std::chrono::duration<double, std::nano> d = Clock::now() - t0;
    return d.count() / double(bytes / TARGET_PAGE_SIZE);
}

// Scans every page so the compiler cannot drop the reads.
size_t count_zero_pages(const uint8_t *p, size_t bytes)
{
    size_t n = 0;
    for (size_t o = 0; o < bytes; o += TARGET_PAGE_SIZE) {
        n += buffer_is_zero_page(p + o);
    }
    return n;
}

// Runs fill(offset) for every chunk of `bytes` from `writers` threads at
// once, chunks dealt round-robin, as the receive threads share one image;
// returns the wall-clock ns per page, or -1 if any fill failed. Concurrency
// is the point: pwrite takes the file's inode lock, so on some file systems
// (huge-page tmpfs) it is the cheaper path for one writer and the dearer
// for two.
template <typename Fill>
double concurrent_fill(size_t bytes, unsigned writers, Fill fill)
{
    std::atomic<bool> go{false}, ok{true};
    std::vector<std::thread> threads;
    for (unsigned w = 0; w < writers; w++) {
        threads.emplace_back([&, w] {
            while (!go.load(std::memory_order_acquire)) {
            }
            for (size_t o = w * kChunk; o < bytes && ok.load(std::memory_order_relaxed);
                 o += writers * kChunk) {
                if (!fill(o)) {
                    ok = false;
                }
            }
        });
    }
    auto t0 = Clock::now();
    go.store(true, std::memory_order_release);
    for (auto &t : threads) {
        t.join();
    }
    return ok ? ns_per_page(t0, bytes) : -1;
}

// Fills `s` through a fresh mapping; returns ns/page, or -1. `small`: a
// huge-page tmpfs mapped as a RAM image is, faulting 4 KiB pages.
double mapped_fill(const ScratchFile &s, const uint8_t *src, unsigned writers, bool small)
{
    uint8_t *m = s.map(PROT_READ | PROT_WRITE);
    if (!m) {
        return -1;
    }
    if (small) {
        (void)madvise(m, s.bytes(), MADV_NOHUGEPAGE);
    }
    double ns = concurrent_fill(s.bytes(), writers, [&](size_t o) {
        if (madvise(m + o, kChunk, MADV_POPULATE_WRITE) != 0) {
            return false;
        }
        std::memcpy(m + o, src, kChunk);
        return true;
    });
    munmap(m, s.bytes());
    return ns;
}

double pwrite_fill(const ScratchFile &s, const uint8_t *src, unsigned writers)
{
    return concurrent_fill(s.bytes(), writers, [&](size_t o) {
        return pwrite(s.fd(), src, kChunk, off_t(o)) == ssize_t(kChunk);
    });
}

// Fills `s` through a fill mapping (UFFDIO_COPY); -1 where there is none.
double fill_fill(const ScratchFile &s, const uint8_t *src, unsigned writers)
{
    auto f = FillMapping::open(s.fd(), s.bytes(), "calibration");
    if (!f) {
        return -1;
    }
    return concurrent_fill(s.bytes(), writers, [&](size_t o) {
        return bool((*f)->store(o, src, kChunk));
    });
}

double pread_scan(const ScratchFile &s, uint8_t *buf, size_t *sink)
{
    auto t0 = Clock::now();
    for (size_t o = 0; o < s.bytes(); o += kChunk) {
        if (pread(s.fd(), buf, kChunk, off_t(o)) != ssize_t(kChunk)) {
            return -1;
        }
        *sink += count_zero_pages(buf, kChunk);
    }
    return ns_per_page(t0, s.bytes());
}

double mapped_scan(const ScratchFile &s, size_t *sink)
{
    uint8_t *m = s.map(PROT_READ);
    if (!m) {
        return -1;
    }
    auto t0 = Clock::now();
    bool ok = true;
    for (size_t o = 0; o < s.bytes() && ok; o += kChunk) {
        ok = madvise(m + o, kChunk, MADV_POPULATE_READ) == 0;
        *sink += ok ? count_zero_pages(m + o, kChunk) : 0;
    }
    double ns = ok ? ns_per_page(t0, s.bytes()) : -1;
    munmap(m, s.bytes());
    return ns;
}

} // namespace

PagePathCosts measure_page_paths(const std::string &dir, const Backing &backing, size_t bytes)
{
    bytes = (bytes + backing.page_size - 1) / backing.page_size * backing.page_size;
    PagePathCosts c;
    std::unique_ptr<uint8_t[]> src(new uint8_t[kChunk]);
    for (size_t i = 0; i < kChunk; i++) {
        src[i] = uint8_t(i * 7 + 1); // no zero pages: every check reads a whole page
    }
    size_t sink = 0;
    // Best of two rounds, each on fresh files: a first allocation on a
    // freshly mounted file system can pay a one-off cost (compaction for
    // huge pages) that says nothing about the migration that follows.
    auto best = [](double a, double b) { return a < 0 ? b : b < 0 ? a : std::min(a, b); };
    // Writers: as many as the cores that receive threads can run on (a
    // migration has at least as many channels as that, usually).
    unsigned writers = std::clamp(std::thread::hardware_concurrency(), 1u, 4u);
    // A huge-page tmpfs is written through its mapping or filled (a pwrite
    // would allocate huge folios): its reads are measured on the file the
    // mapping wrote.
    bool huge_tmpfs = backing.kind == BackingKind::TmpfsHuge;
    bool shmem = huge_tmpfs || backing.kind == BackingKind::Tmpfs;
    for (int round = 0; round < 2; round++) {
        ScratchFile mapped(dir, "calibrate-m", bytes);
        if (mapped.ok()) {
            c.map_write_ns =
                best(c.map_write_ns, mapped_fill(mapped, src.get(), writers, huge_tmpfs));
        }
        if (shmem) {
            ScratchFile filled(dir, "calibrate-u", bytes);
            if (filled.ok()) {
                c.fill_ns = best(c.fill_ns, fill_fill(filled, src.get(), writers));
            }
        }
        if (huge_tmpfs) {
            if (mapped.ok() && c.map_write_ns >= 0) {
                c.pread_ns = best(c.pread_ns, pread_scan(mapped, src.get(), &sink));
                c.map_read_ns = best(c.map_read_ns, mapped_scan(mapped, &sink));
            }
            continue;
        }
        ScratchFile filed(dir, "calibrate-f", bytes);
        bool pwrite_ok = filed.ok() && backing.can_pwrite();
        if (pwrite_ok) {
            c.pwrite_ns = best(c.pwrite_ns, pwrite_fill(filed, src.get(), writers));
        }
        // Read costs on whichever file holds data, through fresh views of it.
        const ScratchFile &full = pwrite_ok ? filed : mapped;
        if (pwrite_ok || c.map_write_ns >= 0) {
            c.pread_ns = best(c.pread_ns, pread_scan(full, src.get(), &sink));
            c.map_read_ns = best(c.map_read_ns, mapped_scan(full, &sink));
        }
    }
    if (sink == size_t(-1)) {
        c.pread_ns = -1; // keeps sink alive
    }
    return c;
}

namespace {

// The cheaper of two measured costs; `fallback` when neither was measured.
PageAccess cheaper(double file_ns, double mapped_ns, PageAccess fallback)
{
    if (file_ns < 0 && mapped_ns < 0) {
        return fallback;
    }
    if (file_ns < 0) {
        return PageAccess::Mapped;
    }
    if (mapped_ns < 0) {
        return PageAccess::File;
    }
    return mapped_ns < file_ns ? PageAccess::Mapped : PageAccess::File;
}

std::string describe(const PagePaths &p, const char *how)
{
    auto ns = [](double v) { return v < 0 ? std::string("n/a") : fmt::format("{:.0f}", v); };
    std::string fill = p.costs.fill_ns < 0 ? "" : fmt::format(", fill {}", ns(p.costs.fill_ns));
    return fmt::format("{}: read {} (pread {} ns/page, mapped {}), write {} (pwrite {} ns/page, "
                       "mapped {}{})",
                       how, page_access_name(p.read), ns(p.costs.pread_ns),
                       ns(p.costs.map_read_ns), page_access_name(p.write), ns(p.costs.pwrite_ns),
                       ns(p.costs.map_write_ns), fill);
}

} // namespace

PagePaths choose_page_paths(const std::string &dir, const Backing &backing, PagePathMode mode,
                            bool receives)
{
    PagePaths p;
    if (mode != PagePathMode::Auto) {
        p.read = p.write = mode == PagePathMode::Mapped ? PageAccess::Mapped : PageAccess::File;
        // pwrite is not there on hugetlbfs, and on a huge-page tmpfs it
        // would allocate a 2 MiB folio for each page it writes.
        if (!backing.can_pwrite() || backing.kind == BackingKind::TmpfsHuge) {
            p.write = PageAccess::Mapped;
        }
        p.write_without_fill = p.write;
        bool fill = mode == PagePathMode::Fill && receives;
        if (fill && backing.can_fill()) {
            p.write = PageAccess::Fill; // RamImage falls back where it cannot
        }
        p.why = describe(p, "forced");
        if (fill && !backing.can_fill()) {
            p.why += fmt::format("; no fill on {}", backing.name());
        }
        return p;
    }
    if (backing.kind == BackingKind::Hugetlbfs) {
        // One fault maps a whole huge page, so the mapping costs a copy and
        // 1/512 of a fault per page (and write(2) is not there).
        p.read = p.write = p.write_without_fill = PageAccess::Mapped;
        p.why = describe(p, fmt::format("huge pages ({} KiB)", backing.page_size >> 10).c_str());
        return p;
    }
    static std::mutex mu;
    static std::map<std::string, PagePathCosts> measured; // by directory; protected by mu
    std::lock_guard<std::mutex> lk(mu);
    auto it = measured.find(dir);
    if (it == measured.end()) {
        it = measured.emplace(dir, measure_page_paths(dir, backing, 8 << 20)).first;
    }
    p.costs = it->second;
    p.read = cheaper(p.costs.pread_ns, p.costs.map_read_ns, PageAccess::File);
    if (backing.kind == BackingKind::TmpfsHuge) {
        // The image's mapping faults 4 KiB pages (RamImage::init), and so
        // does a fill (UFFDIO_COPY makes small pages), but a pwrite has no
        // mapping to say so: it would allocate a 2 MiB folio for each page
        // it writes. A pread allocates nothing (a hole reads as zeros).
        p.write = PageAccess::Mapped;
    } else {
        p.write = backing.can_pwrite()
                      ? cheaper(p.costs.pwrite_ns, p.costs.map_write_ns, PageAccess::File)
                      : PageAccess::Mapped;
    }
    // A fill against pwrite: the calibration's memory is warm, but in a
    // migration a first touch can wait while the host backs the page, and
    // a pwrite waits holding the inode lock, so every receive thread
    // waits with it. Measured side by side (4 GiB random, 2-core PVM
    // guest, pwrite 830-1200 ns/page and fill 750-900 here): fill 1.54-
    // 1.61 s, pwrite 1.79-2.05 s. So pwrite must be clearly cheaper.
    constexpr double kLockMargin = 1.25;
    p.write_without_fill = p.write;
    double chosen = p.write == PageAccess::File ? p.costs.pwrite_ns * kLockMargin
                                                : p.costs.map_write_ns;
    if (receives && p.costs.fill_ns >= 0 && (chosen < 0 || p.costs.fill_ns < chosen)) {
        p.write = PageAccess::Fill;
    }
    p.why = describe(p, backing.kind == BackingKind::TmpfsHuge
                            ? "measured on a huge-page tmpfs, 4 KiB pages"
                            : "measured");
    return p;
}

} // namespace qmigd
