// The destination's mapped-ram reads: pages from their places in the file (mapped_ram_load.h).
#include "daemon/dest/mapped_ram_load.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <atomic>
#include <bit>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/socket_io.h"
#include "daemon/thread_name.h"
#include "daemon/thread_safety.h"

namespace qmigd {

namespace {

// One read request covers up to kSpanBytes of the pages region; a hole of
// more than kGapBytes between two runs of pages ends it. Reading a hole
// into a scratch buffer costs its bytes; starting another request costs
// the request: here a virtual disk serves 1 MiB O_DIRECT reads at 4
// threads at ~1.2 GB/s and 16 MiB ones at 2-3.5 GB/s, 0.3-0.8 ms per
// request, which a 1 MiB hole costs too. (QEMU reads each run on its own,
// in pieces of at most 1 MiB.)
constexpr uint64_t kSpanBytes = 8 << 20;
constexpr uint64_t kGapBytes = 1 << 20;
// Each run is one iovec and each hole another.
constexpr int kSpanIovs = 1024;

struct Run {
    uint64_t offset; // in the block
    uint64_t len;
};

struct Span {
    size_t first; // runs [first, first + count)
    size_t count;
};

// The bitmap of pages present, as host words. Bits past the block's last
// page are dropped: they name no page of ours.
Result<std::vector<uint64_t>> read_bitmap(const MappedRamFileIn &in, const MappedRamHeader &h,
                                          uint64_t pages)
{
    std::vector<uint8_t> raw(mapped_ram_bitmap_size(pages));
    if (Status st = pread_full(in.fd, raw.data(), raw.size(), h.bitmap_offset); !st) {
        return Error(st.error()).prepend("Error reading dirty bitmap: ");
    }
    std::vector<uint64_t> words(raw.size() / 8);
    for (size_t w = 0; w < words.size(); w++) {
        words[w] = get_le64(&raw[w * 8]);
    }
    if (pages % 64) {
        words.back() &= (uint64_t(1) << (pages % 64)) - 1;
    }
    return words;
}

// Runs of set bits, none longer than a span.
std::vector<Run> runs_of(const std::vector<uint64_t> &bits, uint64_t pages)
{
    std::vector<Run> out;
    uint64_t p = 0;
    auto set = [&](uint64_t i) { return (bits[i / 64] >> (i % 64)) & 1; };
    while (p < pages) {
        if (bits[p / 64] == 0 && p % 64 == 0) {
            p += 64;
            continue;
        }
        if (!set(p)) {
            p++;
            continue;
        }
        uint64_t start = p;
        while (p < pages && set(p) && (p - start + 1) * TARGET_PAGE_SIZE <= kSpanBytes) {
            p++;
        }
        out.push_back({start * TARGET_PAGE_SIZE, (p - start) * TARGET_PAGE_SIZE});
    }
    return out;
}

// Consecutive runs that one read request covers.
std::vector<Span> spans_of(const std::vector<Run> &runs)
{
    std::vector<Span> out;
    for (size_t i = 0; i < runs.size();) {
        size_t j = i + 1;
        while (j < runs.size() && int(2 * (j - i + 1)) <= kSpanIovs &&
               runs[j].offset - (runs[j - 1].offset + runs[j - 1].len) <= kGapBytes &&
               runs[j].offset + runs[j].len - runs[i].offset <= kSpanBytes) {
            j++;
        }
        out.push_back({i, j - i});
        i = j;
    }
    return out;
}

// One span, its runs read straight into the pre-faulted mapping whatever
// the image's page path (a file read is a kernel copy either way, and into
// the mapping it is one copy with the faults taken in the kernel, where a
// buffer would add a pwrite), its holes into `scratch` (kGapBytes, page
// aligned for O_DIRECT; what lands there is dropped).
Status load_span(int fd, RamImage &img, const MappedRamHeader &h, const std::vector<Run> &runs,
                 const Span &sp, uint8_t *scratch)
{
    struct iovec iov[kSpanIovs];
    int n = 0;
    for (size_t k = sp.first; k < sp.first + sp.count; k++) {
        if (k > sp.first) {
            uint64_t prev_end = runs[k - 1].offset + runs[k - 1].len;
            if (runs[k].offset > prev_end) {
                iov[n++] = {scratch, runs[k].offset - prev_end};
            }
        }
        auto dst = img.writable_range(runs[k].offset, runs[k].len);
        QMIGD_TRY(dst);
        iov[n++] = {*dst, runs[k].len};
    }
    return preadv_full(fd, iov, n, h.pages_offset + runs[sp.first].offset);
}

// Every page whose bit is clear reads as zero (a fresh image already does:
// its known holes are skipped a word at a time).
Status zero_clear_pages(RamImage &img, const std::vector<uint64_t> &bits, uint64_t pages)
{
    for (size_t w = 0; w < bits.size(); w++) {
        uint64_t valid = (w + 1) * 64 <= pages ? ~uint64_t(0)
                                                : (uint64_t(1) << (pages % 64)) - 1;
        uint64_t clear = ~bits[w] & valid & ~img.known_zero_word(w);
        for (; clear; clear &= clear - 1) {
            uint64_t page = w * 64 + uint64_t(std::countr_zero(clear));
            QMIGD_TRY(img.zero_page(page << TARGET_PAGE_BITS));
        }
    }
    return {};
}

} // namespace

Status mapped_ram_load_block(const MappedRamFileIn &in, RAMBlock &block,
                             const MappedRamHeader &h, MappedRamCounts *counts)
{
    const std::string &id = block.desc.idstr;
    uint64_t pages = block.desc.used_length >> TARGET_PAGE_BITS;
    QMIGD_TRY(mapped_ram_header_check(h, id, block.desc.used_length, in.file_size));
    auto bits = read_bitmap(in, h, pages);
    QMIGD_TRY(bits);
    std::vector<Run> runs = runs_of(*bits, pages);
    std::vector<Span> todo = spans_of(runs);
    spdlog::debug("mapped-ram load '{}': {} runs in {} spans", id, runs.size(), todo.size());
    for (const Run &r : runs) { // before the readers: see RamImage::allocate
        block.image->allocate(r.offset, r.len);
    }
    spdlog::debug("mapped-ram load '{}': pages allocated", id);

    std::atomic<size_t> next{0};
    Mutex err_mu;
    std::optional<Error> err; // first failure, protected by err_mu
    std::atomic<bool> stop{false};
    auto worker = [&](unsigned t) {
        int fd = in.direct_fds.empty() ? in.fd : in.direct_fds[t % in.direct_fds.size()].get();
        std::unique_ptr<uint8_t, decltype(&std::free)> scratch(
            static_cast<uint8_t *>(std::aligned_alloc(TARGET_PAGE_SIZE, kGapBytes)), &std::free);
        for (size_t i; !stop && (i = next.fetch_add(1)) < todo.size();) {
            uint64_t at = runs[todo[i].first].offset;
            Status st = scratch ? load_span(fd, *block.image, h, runs, todo[i], scratch.get())
                                : Status(Error("out of memory"));
            if (!st) {
                st = Error(st.error()).prepend(fmt::format("({}) failed to read page {:x} from "
                                                           "file offset {:x}: ",
                                                           id, at, h.pages_offset + at));
                MutexLock lk(err_mu);
                if (!err) {
                    err = st.error();
                }
                stop = true;
            }
        }
    };
    unsigned n = unsigned(std::min<size_t>(std::max(in.threads, 1u), std::max<size_t>(todo.size(), 1)));
    std::vector<std::thread> threads;
    for (unsigned t = 1; t < n; t++) {
        threads.emplace_back([&, t] {
            set_thread_name("mig/dst/recv_" + std::to_string(t));
            worker(t);
        });
    }
    worker(0); // the load thread reads too
    for (auto &t : threads) {
        t.join();
    }
    if (err) {
        return *err;
    }
    spdlog::debug("mapped-ram load '{}': pages read", id);
    QMIGD_TRY(zero_clear_pages(*block.image, *bits, pages));
    uint64_t normal = 0;
    for (uint64_t w : *bits) {
        normal += uint64_t(std::popcount(w));
    }
    counts->normal += normal;
    counts->zero += pages - normal;
    return {};
}

} // namespace qmigd
