// `qmigd guest`: the stand-in vCPU's write loop, its rates and patterns.
#include "daemon/tools/guest.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <thread>

#include <spdlog/spdlog.h>

#include "daemon/ram_blocks.h"
#include "ramstate/guest_control.h"

namespace qmigd {

namespace {

std::atomic<bool> g_stop{false};

struct XorShift {
    uint64_t s;
    uint64_t next()
    {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        return s;
    }
};

// Picks the next page to write, as a global page index over all blocks.
class PagePicker {
public:
    PagePicker(GuestPattern p, uint64_t total, uint64_t hot) : pattern_(p), total_(total),
        hot_(std::max<uint64_t>(1, std::min(hot, total)))
    {
    }
    uint64_t next(XorShift &rng)
    {
        switch (pattern_) {
        case GuestPattern::Sequential:
            cursor_ = (cursor_ + 1) % total_;
            return cursor_;
        case GuestPattern::Hot:
            return rng.next() % hot_;
        case GuestPattern::Random:
            break;
        }
        return rng.next() % total_;
    }

private:
    GuestPattern pattern_;
    uint64_t total_, hot_;
    uint64_t cursor_ = ~uint64_t(0);
};

// New contents for a page: one in eight becomes all zeros, the rest get
// fresh pseudo-random words, so every write changes the page. With
// `bytes` below a page, only that many (in words, from a random word on,
// wrapping within the page) change.
void write_page(uint8_t *page, XorShift &rng, uint64_t bytes)
{
    if (bytes < TARGET_PAGE_SIZE) {
        size_t words = TARGET_PAGE_SIZE / 8, n = std::max<size_t>(1, bytes / 8);
        size_t at = rng.next() % words;
        for (size_t i = 0; i < n; i++) {
            uint64_t x = rng.next();
            std::memcpy(page + (at + i) % words * 8, &x, 8);
        }
        return;
    }
    if (rng.next() % 8 == 0) {
        std::memset(page, 0, TARGET_PAGE_SIZE);
        return;
    }
    uint64_t w[TARGET_PAGE_SIZE / 8];
    for (auto &x : w) {
        x = rng.next();
    }
    std::memcpy(page, w, sizeof(w));
}

} // namespace

Status run_guest(const GuestOptions &opts)
{
    // The workload writes through the mapping, like a vCPU: nothing to measure.
    auto blocks = ram_blocks_open(opts.ram_specs, true, PagePathMode::File);
    QMIGD_TRY(blocks);
    const RamImage &first = *blocks->front().image;
    SideFile ctl = side_file(opts.control_path, first.path(), first.backing(), ".ctl");
    auto control = GuestControl::open(ctl.path, ctl.name);
    QMIGD_TRY(control);
    GuestControl &gc = **control;

    uint64_t total = 0;
    for (const auto &b : *blocks) {
        total += b.image->pages();
    }
    PagePicker picker(opts.pattern, total, opts.hot_set / TARGET_PAGE_SIZE);
    XorShift rng{opts.seed * 0x9e3779b97f4a7c15ull + 1};

    std::signal(SIGTERM, [](int) { g_stop = true; });
    std::signal(SIGINT, [](int) { g_stop = true; });
    gc.attach();
    spdlog::info("guest: {} pages/s over {} pages, control {}", opts.rate, total, ctl.path);

    using Clock = std::chrono::steady_clock;
    auto start = Clock::now();
    auto pace_start = start;
    double credit_pages = 0; // pages allowed but not yet written
    while (!g_stop) {
        if (opts.duration > 0 &&
            std::chrono::duration<double>(Clock::now() - start).count() >= opts.duration) {
            break;
        }
        // Throttled like a vCPU: it runs (100 - throttle)% of the time.
        auto now = Clock::now();
        double dt = std::chrono::duration<double>(now - pace_start).count();
        pace_start = now;
        credit_pages += dt * double(opts.rate) * (100 - gc.throttle()) / 100.0;
        credit_pages = std::min(credit_pages, double(opts.rate) / 10); // no long bursts
        while (credit_pages >= 1 && !g_stop) {
            if (!gc.check_pause(g_stop)) {
                pace_start = Clock::now(); // paused time earns nothing
                credit_pages = 0;
                break;
            }
            uint64_t page = picker.next(rng);
            size_t b = 0;
            while (page >= (*blocks)[b].image->pages()) {
                page -= (*blocks)[b].image->pages();
                b++;
            }
            // Write first, then mark: a sync that sees the bit sees the data.
            write_page((*blocks)[b].image->host(page * TARGET_PAGE_SIZE), rng, opts.write_bytes);
            (*blocks)[b].dirty->set_dirty(page);
            gc.count_write();
            credit_pages -= 1;
        }
        gc.check_pause(g_stop);
        std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    gc.detach();
    spdlog::info("guest: stopped after {} pages written", gc.pages_written());
    return {};
}

} // namespace qmigd
