// `qmigd limits`: each cost measured (faults, copies, zero scan, loopback TCP, pwrite).
#include "daemon/tools/limits.h"

#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <chrono>
#include <cstring>
#include <csetjmp>
#include <csignal>
#include <fcntl.h>
#include <memory>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>

#include "protocol/qemu_format.h"
#include "ramstate/backing.h"
#include "ramstate/page_path.h"
#include "ramstate/populate.h"
#include "ramstate/scratch_file.h"
#include "ramstate/zero_page.h"

namespace qmigd {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0)
{
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

double cpu_seconds()
{
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

// An anonymous buffer, faulted in.
std::unique_ptr<uint8_t[]> buffer(size_t bytes, int fill)
{
    std::unique_ptr<uint8_t[]> b(new uint8_t[bytes]);
    std::memset(b.get(), fill, bytes);
    return b;
}

double zero_scan_gbps(size_t bytes)
{
    auto b = buffer(bytes, 0);
    size_t zero = 0;
    auto t0 = Clock::now();
    for (int rep = 0; rep < 3; rep++) {
        for (size_t o = 0; o < bytes; o += TARGET_PAGE_SIZE) {
            zero += buffer_is_zero_page(b.get() + o);
        }
    }
    double s = seconds_since(t0);
    return zero ? 3.0 * double(bytes) / s / 1e9 : 0;
}

double memcpy_gbps(size_t bytes)
{
    auto a = buffer(bytes, 1), b = buffer(bytes, 2);
    auto t0 = Clock::now();
    for (int rep = 0; rep < 3; rep++) {
        std::memcpy(b.get(), a.get(), bytes);
    }
    double s = seconds_since(t0);
    return b[bytes / 2] == 1 ? 3.0 * double(bytes) / s / 1e9 : 0;
}

// The fault pass writes into a mapping of a file the file system may have
// no room for (a small tmpfs, too few huge pages): the kernel answers such
// a write with SIGBUS. The pass catches it and reports -1 instead.
// volatile: the store must be made before the loop, which the compiler
// could otherwise sink past it (the handler then saw nullptr).
thread_local sigjmp_buf *volatile t_sigbus_jump = nullptr;

void on_sigbus(int sig)
{
    if (t_sigbus_jump) {
        siglongjmp(*t_sigbus_jump, 1);
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

// Writes one byte into each page of m; false if the file system ran out.
bool touch_pages(uint8_t *m, size_t bytes)
{
    struct sigaction sa {}, old {};
    sa.sa_handler = on_sigbus;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &old);
    sigjmp_buf jump;
    bool ok = false;
    if (sigsetjmp(jump, 1) == 0) {
        t_sigbus_jump = &jump;
        for (size_t o = 0; o < bytes; o += TARGET_PAGE_SIZE) {
            static_cast<volatile uint8_t *>(m)[o] = 1;
        }
        ok = true;
    }
    t_sigbus_jump = nullptr;
    sigaction(SIGBUS, &old, nullptr);
    return ok;
}

// A shared mapping of all of `f`, or nullptr. On a huge-page tmpfs it
// faults 4 KiB pages, as a RAM image's does (`small`: RamImage::init).
uint8_t *fresh_mapping(const ScratchFile &f, bool small)
{
    uint8_t *m = f.ok() ? f.map(PROT_READ | PROT_WRITE) : nullptr;
    if (m && small) {
        (void)madvise(m, f.bytes(), MADV_NOHUGEPAGE);
    }
    return m;
}

// First write into each page of a fresh shared mapping of a fresh file:
// what a receiver that writes through the mapping pays per page.
double fault_pass_ns(const std::string &dir, size_t bytes, bool small)
{
    ScratchFile f(dir, "limits", bytes);
    uint8_t *m = fresh_mapping(f, small);
    if (!m) {
        return -1;
    }
    auto t0 = Clock::now();
    bool ok = touch_pages(m, bytes);
    double s = seconds_since(t0);
    munmap(m, bytes);
    return ok ? s * 1e9 / double(bytes / TARGET_PAGE_SIZE) : -1;
}

// The first of a few passes, and the least. On a paravirtualised host the
// first touch of memory the guest kernel gave back (free page reporting
// returns free 2 MiB blocks to the host within seconds) includes the host
// backing it again: ~9.5 us per 4 KiB against 0.25 us for memory used a
// moment ago (seen: two passes at 9.7 and 9.2 us, the third at 0.25). A
// hugetlbfs pool keeps its pages, so migrations there pay the least; a
// huge-page tmpfs takes its pages from free memory, so a destination
// created seconds after the last one pays the first.
// The idle pass is one more, after the memory the passes freed has sat
// unused for idle_s seconds: what a destination host that waited for a
// migration pays (at 8 s on the VM this was written on, 2x the least).
struct FaultCosts {
    double first_ns = -1, least_ns = -1, idle_ns = -1;
};

FaultCosts fault_ns_per_page(const std::string &dir, size_t bytes, unsigned idle_s, bool small)
{
    FaultCosts c;
    for (int pass = 0; pass < 4; pass++) {
        double ns = fault_pass_ns(dir, bytes, small);
        if (pass == 0) {
            c.first_ns = ns;
        }
        c.least_ns = c.least_ns < 0 || (ns >= 0 && ns < c.least_ns) ? ns : c.least_ns;
    }
    if (idle_s > 0) {
        std::this_thread::sleep_for(std::chrono::seconds(idle_s));
        c.idle_ns = fault_pass_ns(dir, bytes, small);
    }
    return c;
}

// The first touch of as much memory as a destination fills, from one
// thread per core as its receive threads do (MADV_POPULATE_WRITE, 512 KiB
// at a time): what the destination's page allocation costs for a stream of
// that size. It depends on the size because this VM's kernel keeps only
// part of its free memory backed by the host: here 1 GiB faults at the
// warm 1.7 us per page 8 s after it was freed, 4 GiB at 5-9 us, and 80%
// of a 4 GiB destination's time is clear_page waiting for the host.
// CPU seconds of all threads, for a bound that adds CPU work.
struct FaultScale {
    double seconds = -1, cpu_seconds = -1;
};

constexpr size_t kFaultChunk = 512 * 1024;

// `bytes`: a multiple of kFaultChunk.
FaultScale fault_at_scale(const std::string &dir, size_t bytes, bool small)
{
    ScratchFile f(dir, "limits", bytes);
    uint8_t *m = fresh_mapping(f, small);
    if (!m) {
        return {};
    }
    unsigned writers = std::max(1u, std::thread::hardware_concurrency());
    std::atomic<bool> ok{true};
    double c0 = cpu_seconds();
    auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (unsigned w = 0; w < writers; w++) {
        threads.emplace_back([&, w] {
            for (size_t o = w * kFaultChunk; o < bytes && ok; o += writers * kFaultChunk) {
                if (madvise(m + o, kFaultChunk, MADV_POPULATE_WRITE) != 0) {
                    ok = false;
                }
            }
        });
    }
    for (auto &t : threads) {
        t.join();
    }
    FaultScale r{seconds_since(t0), cpu_seconds() - c0};
    munmap(m, bytes);
    return ok ? r : FaultScale{};
}

double pwrite_gbps(const std::string &dir, size_t bytes)
{
    ScratchFile f(dir, "limits", bytes);
    auto src = buffer(512 * 1024, 3);
    auto t0 = Clock::now();
    for (size_t o = 0; f.ok() && o < bytes; o += 512 * 1024) {
        if (pwrite(f.fd(), src.get(), 512 * 1024, off_t(o)) != 512 * 1024) {
            return -1;
        }
    }
    return f.ok() ? double(bytes) / seconds_since(t0) / 1e9 : -1;
}

// Where a loopback TCP test's streams write from and read into: either one
// small buffer per thread, which stays in the cache, or slices of a shared
// mapping of a scratch file on the guest's file system, pre-faulted and far
// larger than the cache, as guest RAM is to a migration.
class TcpMemory {
public:
    // Pre-faulted with MADV_POPULATE_WRITE, which fails where a plain write
    // would die of SIGBUS (a full tmpfs, too few huge pages): ok() says.
    TcpMemory(const std::string &dir, size_t bytes) : bytes_(bytes)
    {
        ScratchFile f(dir, "limits", bytes);
        base_ = f.ok() ? f.map(PROT_READ | PROT_WRITE) : nullptr;
        if (!base_) {
            return;
        }
        // Faults are fault_ns_per_page's, not TCP's.
        ok_ = madvise(base_, bytes, MADV_POPULATE_WRITE) == 0;
    }
    TcpMemory() : ok_(true) {}
    ~TcpMemory()
    {
        if (base_) {
            munmap(base_, bytes_);
        }
    }
    TcpMemory(const TcpMemory &) = delete;
    TcpMemory &operator=(const TcpMemory &) = delete;

    bool ok() const { return ok_; }
    bool mapped() const { return base_ != nullptr; }
    // Slice `i` of `n`: a thread's region, written or read 1 MiB at a time.
    std::pair<uint8_t *, size_t> slice(int i, int n) const
    {
        size_t per = bytes_ / size_t(n);
        return {base_ + per * size_t(i), per};
    }

private:
    uint8_t *base_ = nullptr;
    size_t bytes_ = 0;
    bool ok_ = false;
};

// One side of a stream: `chunk`-sized writes or reads walking through
// `region` (a slice of TcpMemory) or reusing one cache-resident buffer.
struct StreamBuffer {
    std::unique_ptr<uint8_t[]> own;
    uint8_t *base;
    size_t size, at = 0;
    StreamBuffer(const TcpMemory &m, int i, int n, size_t chunk)
    {
        if (m.mapped()) {
            std::tie(base, size) = m.slice(i, n);
        } else {
            own = buffer(chunk, 7);
            base = own.get();
            size = chunk;
        }
    }
    uint8_t *next(size_t chunk)
    {
        if (at + chunk > size) {
            at = 0;
        }
        uint8_t *p = base + at;
        at += chunk;
        return p;
    }
};

// 4 streams over loopback, 1 MiB writes, `bytes` in all, between the
// buffers `mem` gives: GB/s, and CPU seconds per GiB (sender and receiver
// are both in this process).
std::pair<double, double> loopback_tcp(size_t bytes, int streams, const TcpMemory &mem)
{
    if (!mem.ok()) {
        return {-1, -1};
    }
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof(a);
    if (lfd < 0 || bind(lfd, reinterpret_cast<sockaddr *>(&a), sizeof(a)) < 0 ||
        listen(lfd, streams) < 0 ||
        getsockname(lfd, reinterpret_cast<sockaddr *>(&a), &alen) < 0) {
        if (lfd >= 0) {
            ::close(lfd);
        }
        return {-1, -1};
    }
    const size_t chunk = 1 << 20, per = bytes / size_t(streams);
    std::vector<std::thread> threads;
    double c0 = cpu_seconds();
    auto t0 = Clock::now();
    for (int i = 0; i < streams; i++) {
        threads.emplace_back([&, i] {
            int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a)) == 0) {
                StreamBuffer b(mem, i, 2 * streams, chunk);
                for (size_t sent = 0; sent < per;) {
                    ssize_t n = write(fd, b.next(chunk), chunk);
                    if (n <= 0) {
                        break;
                    }
                    sent += size_t(n);
                }
            }
            ::close(fd);
        });
        int cfd = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
        threads.emplace_back([&, cfd, i] {
            StreamBuffer b(mem, streams + i, 2 * streams, chunk);
            while (read(cfd, b.next(chunk), chunk) > 0) {
            }
            ::close(cfd);
        });
    }
    for (auto &t : threads) {
        t.join();
    }
    double s = seconds_since(t0), cpu = cpu_seconds() - c0;
    ::close(lfd);
    return {double(bytes) / s / 1e9, cpu / (double(bytes) / double(1 << 30))};
}

// The backing of `dir`'s file system (a default Backing if it cannot tell).
Backing backing_in(const std::string &dir)
{
    ScratchFile probe(dir, "limits", 0);
    if (probe.ok()) {
        if (auto r = backing_of(probe.fd(), probe.path()); r.ok()) {
            return *r;
        }
    }
    return Backing{};
}

} // namespace

nlohmann::json measure_limits(const std::string &dir, unsigned idle_s)
{
    nlohmann::json j;
    j["dir"] = dir;
    Backing b = backing_in(dir);
    j["backing"] = b.name();
    j["zero_scan_gbps"] = zero_scan_gbps(256 << 20);
    j["memcpy_gbps"] = memcpy_gbps(256 << 20);
    FaultCosts faults =
        fault_ns_per_page(dir, 64 << 20, idle_s, b.kind == BackingKind::TmpfsHuge);
    j["fault_ns_per_page"] = faults.least_ns;
    j["fault_fresh_ns_per_page"] = faults.first_ns;
    j["fault_idle_ns_per_page"] = faults.idle_ns;
    j["fault_idle_seconds"] = idle_s;
    j["pwrite_gbps"] = b.can_pwrite() ? pwrite_gbps(dir, 256 << 20) : -1.0;
    // TCP's cost as a migration meets it: pages come from and go to guest
    // memory that the cache does not hold (256 MiB of this file system's
    // memory). The cache-resident figure is kept beside it: sending the same
    // 1 MiB over and over costs a third less CPU on a 1 MiB-L2 machine, a
    // rate no migration of a guest larger than the cache can reach.
    auto [tcp_gbps, tcp_cpu] = loopback_tcp(size_t(2) << 30, 4, TcpMemory(dir, 256 << 20));
    j["tcp_loopback_gbps"] = tcp_gbps;
    j["tcp_cpu_s_per_gib"] = tcp_cpu;
    auto [cached_gbps, cached_cpu] = loopback_tcp(size_t(2) << 30, 4, TcpMemory());
    j["tcp_cached_gbps"] = cached_gbps;
    j["tcp_cached_cpu_s_per_gib"] = cached_cpu;
    PagePathCosts c = measure_page_paths(dir, b, 16 << 20);
    j["page_path_ns"] = {{"pread", c.pread_ns},
                         {"mapped_read", c.map_read_ns},
                         {"pwrite", c.pwrite_ns},
                         {"mapped_write", c.map_write_ns},
                         {"fill", c.fill_ns}};
    j["cores"] = std::thread::hardware_concurrency();
    // The keys keep their names (scripts read them); this says what they hold.
    j["units"] = {{"*_gbps", "GB/s: 10^9 bytes a second (not Gbit/s)"},
                  {"*_ns_per_page", "nanoseconds per 4 KiB page"},
                  {"*_cpu_s_per_gib", "CPU seconds (all threads) per GiB sent"},
                  {"page_path_ns", "nanoseconds per 4 KiB page on each page path"}};
    return j;
}

nlohmann::json measure_fault_scale(const std::string &dir, size_t bytes)
{
    nlohmann::json j;
    j["dir"] = dir;
    Backing b = backing_in(dir);
    // Whole chunks, and what is reported is what was faulted.
    bytes = (bytes + kFaultChunk - 1) / kFaultChunk * kFaultChunk;
    FaultScale f = fault_at_scale(dir, bytes, b.kind == BackingKind::TmpfsHuge);
    j["fault_bytes"] = bytes;
    j["fault_seconds"] = f.seconds;
    j["fault_cpu_seconds"] = f.cpu_seconds;
    double pages = double(std::max<size_t>(1, bytes / TARGET_PAGE_SIZE));
    j["fault_cpu_ns_per_page"] = f.cpu_seconds < 0 ? -1.0 : f.cpu_seconds * 1e9 / pages;
    j["threads"] = std::max(1u, std::thread::hardware_concurrency());
    return j;
}

} // namespace qmigd
