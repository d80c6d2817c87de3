// PostcopyWorkingSet: a parked VM's recorded working set sent first, and this resume's requests recorded.
#include "daemon/source/postcopy_working_set.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

#include "daemon/source/page_requests.h"
#include "protocol/qemu_format.h"

namespace qmigd {

namespace {

// A piece of a recorded range sent at once: a request that comes in
// meanwhile waits behind at most this many pages on the main channel.
constexpr uint64_t kWorkingSetPiece = 16;

// A first resume holds the walk back until the guest asks for nothing for
// this long (it has its early pages, or it computes) or the window ends.
constexpr std::chrono::milliseconds kHoldQuiet(300);

bool ws_bit(const std::vector<uint64_t> &bm, uint64_t page)
{
    return (bm[page / 64] >> (page % 64)) & 1;
}

void ws_set(std::vector<uint64_t> &bm, uint64_t page, bool on)
{
    uint64_t m = uint64_t(1) << (page % 64);
    bm[page / 64] = on ? bm[page / 64] | m : bm[page / 64] & ~m;
}

} // namespace

PostcopyWorkingSet::PostcopyWorkingSet(std::shared_ptr<const ParkedVm> vm,
                                       const WorkingSetOptions &opts)
    : vm_(std::move(vm)), opts_(opts)
{
    // What the file format holds at most (working_set_decode() refuses more).
    opts_.max_pages = std::min(opts_.max_pages, kWorkingSetMaxPages);
    for (const auto &b : vm_->blocks) {
        size_t words = size_t((b.size / TARGET_PAGE_SIZE + 63) / 64);
        recorded_.emplace_back(words, 0);
        sent_.emplace_back(words, 0);
    }
    auto ranges = working_set_read(*vm_);
    if (!ranges) {
        spdlog::warn("migration: ignoring the working set (this resume records anew): {}",
                     ranges.error().message());
    } else {
        loaded_ = std::move(*ranges);
    }
    // The record starts as the one read, up to the cap (pages already in
    // it are not recorded twice).
    for (const auto &r : loaded_) {
        for (uint64_t i = 0; i < r.pages; i++) {
            record(r.block, r.offset / TARGET_PAGE_SIZE + i);
        }
    }
    added_ = false;
    can_record_ = opts_.window_s > 0 && opts_.max_pages > 0;
    if (can_record_ && ::access(vm_->dir.c_str(), W_OK) != 0) {
        spdlog::info("migration: '{}' is not writable ({}): resuming without recording the "
                     "working set",
                     vm_->dir, std::strerror(errno));
        can_record_ = false;
    }
    // Counted as the record holds them: a page the file names twice once.
    spdlog::info("migration: working set of {} pages in {} ranges to send first",
                 record_pages_, record_.size());
}

void PostcopyWorkingSet::start()
{
    started_ = std::chrono::steady_clock::now();
    last_request_ = *started_;
}

bool PostcopyWorkingSet::holding_walk() const
{
    return recording() &&
           std::chrono::steady_clock::now() - last_request_ < kHoldQuiet;
}

WorkingSetRange PostcopyWorkingSet::take_piece(const WorkingSetRange &from)
{
    WorkingSetRange piece{from.block, from.offset + next_page_ * TARGET_PAGE_SIZE,
                          std::min(kWorkingSetPiece, from.pages - next_page_)};
    next_page_ += piece.pages;
    return piece;
}

// The second pass: the aligned span around each recorded range, each span
// once (pages in it already sent are skipped by the sender).
std::optional<WorkingSetRange> PostcopyWorkingSet::next_span()
{
    const uint64_t n = opts_.around_pages;
    while (next_page_ == span_.pages) {
        if (next_range_ == loaded_.size()) {
            return std::nullopt;
        }
        const WorkingSetRange &r = loaded_[next_range_++];
        uint64_t block_pages = vm_->blocks[r.block].size / TARGET_PAGE_SIZE;
        uint64_t first = r.offset / TARGET_PAGE_SIZE / n * n;
        uint64_t end = std::min(block_pages, (r.offset / TARGET_PAGE_SIZE + r.pages + n - 1) / n * n);
        next_page_ = 0;
        span_ = {r.block, first * TARGET_PAGE_SIZE, 0};
        if (spans_done_.insert(uint64_t(r.block) << 40 | first / n).second) {
            span_.pages = end - first;
        }
    }
    return take_piece(span_);
}

std::optional<WorkingSetRange> PostcopyWorkingSet::next()
{
    if (around_) {
        return next_span();
    }
    if (next_range_ == loaded_.size()) {
        if (opts_.around_pages <= 1) {
            return std::nullopt;
        }
        around_ = true;
        next_range_ = 0;
        next_page_ = 0;
        span_ = {};
        return next_span();
    }
    const WorkingSetRange &r = loaded_[next_range_];
    WorkingSetRange piece = take_piece(r);
    if (next_page_ == r.pages) {
        next_range_++;
        next_page_ = 0;
    }
    return piece;
}

void PostcopyWorkingSet::sending(const WorkingSetRange &r, std::span<const uint64_t> still)
{
    uint64_t first = r.offset / TARGET_PAGE_SIZE;
    for (uint64_t p = first; p < first + r.pages; p++) {
        if ((still[p / 64] >> (p % 64)) & 1) {
            ws_set(sent_[r.block], p, true);
            sent_pages_++;
        }
    }
}

bool PostcopyWorkingSet::recording() const
{
    if (!can_record_ || !started_ || record_pages_ >= opts_.max_pages) {
        return false;
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - *started_).count() <
           opts_.window_s;
}

void PostcopyWorkingSet::requested(const PageRequest &r)
{
    bool rec = recording();
    if (started_) {
        last_request_ = std::chrono::steady_clock::now();
    }
    uint64_t first = r.offset / TARGET_PAGE_SIZE;
    uint64_t end = std::min<uint64_t>(first + r.len / TARGET_PAGE_SIZE,
                                      vm_->blocks[r.block].size / TARGET_PAGE_SIZE);
    for (uint64_t p = first; p < end; p++) {
        if (ws_bit(sent_[r.block], p)) {
            ws_set(sent_[r.block], p, false); // counted once
            requested_anyway_++;
        }
        if (rec && record_pages_ < opts_.max_pages) {
            record(r.block, p);
        }
    }
}

// Appends a page not recorded yet, extending the last range when it is
// the page right after it.
void PostcopyWorkingSet::record(size_t block, uint64_t page)
{
    if (record_pages_ >= opts_.max_pages || record_.size() >= kWorkingSetMaxRanges ||
        ws_bit(recorded_[block], page)) {
        return;
    }
    ws_set(recorded_[block], page, true);
    record_pages_++;
    added_ = true;
    uint64_t offset = page * TARGET_PAGE_SIZE;
    if (!record_.empty()) {
        WorkingSetRange &last = record_.back();
        if (last.block == block && last.offset + last.pages * TARGET_PAGE_SIZE == offset &&
            last.pages < UINT32_MAX) {
            last.pages++;
            return;
        }
    }
    record_.push_back({block, offset, 1});
}

void PostcopyWorkingSet::finish()
{
    if (!can_record_ || !added_) {
        return;
    }
    if (Status st = working_set_write(*vm_, record_); !st) {
        spdlog::warn("migration: the working set was not kept: {}", st.error().message());
        return;
    }
    spdlog::info("migration: working set of {} pages in {} ranges kept in {}", record_pages_,
                 record_.size(), working_set_path(vm_->dir));
    added_ = false;
}

} // namespace qmigd
