// A parked VM's working set on its postcopy resume (daemon/park/working_set.h):
// the pages an earlier resume's destination asked for first are sent right
// after RUN, before the background walk, and the pages this destination
// asks for in its first moments are recorded for the next resume.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_set>
#include <vector>

#include "daemon/park/working_set.h"

namespace qmigd {

struct PageRequest;

// Thread ownership: the migration thread's alone (it pops the requests,
// sends the pages and writes the record), from setup to the end.
class PostcopyWorkingSet {
public:
    // Reads DIR/working-set.bin: a bad file is said once in the log and
    // ignored (nothing is sent first, and this resume records anew). A
    // directory this process cannot write is resumed without recording.
    PostcopyWorkingSet(std::shared_ptr<const ParkedVm> vm, const WorkingSetOptions &opts);

    // The package went: the destination's guest runs, the window opens.
    void start();
    // The next few pages to send first (a piece of a recorded range, so
    // that a request waits at most that long): the recorded pages, then
    // the spans around them; none once all went.
    std::optional<WorkingSetRange> next();
    // While this resume records: the background walk waits (requests and
    // the working set go) until the window ends or the guest has asked for
    // nothing for a while, so that the record holds every page the guest
    // touched early, not only those the walk had not brought yet; and the
    // guest's first moments do not share the CPU with the walk's pages.
    bool holding_walk() const;
    // The recorded pages went; next() gives the spans around them.
    bool in_spans() const { return around_; }
    // Before they go: which of the piece's pages are still to send
    // (`still`: the block's migration bitmap), i.e. go as the working set.
    void sending(const WorkingSetRange &r, std::span<const uint64_t> still);
    // A page request as popped: counted if it asks for a page the working
    // set already sent, recorded while the window is open.
    void requested(const PageRequest &r);
    // Postcopy completed: the record, when this resume added to it, is
    // written into the directory (a failure is logged, not the migration's).
    void finish();

    uint64_t pages_sent() const { return sent_pages_; }
    uint64_t requested_anyway() const { return requested_anyway_; }

private:
    bool recording() const;
    void record(size_t block, uint64_t page);

    std::shared_ptr<const ParkedVm> vm_;
    WorkingSetOptions opts_; // max_pages within the format's limit
    std::optional<WorkingSetRange> next_span();
    // The piece of `from` (a loaded range or span_) at next_page_, at most
    // kWorkingSetPiece pages; next_page_ moves past it.
    WorkingSetRange take_piece(const WorkingSetRange &from);

    std::vector<WorkingSetRange> loaded_; // what is sent first, as read
    size_t next_range_ = 0;
    uint64_t next_page_ = 0; // in loaded_[next_range_] or in span_
    bool around_ = false;     // the second pass: the spans around them
    WorkingSetRange span_{};  // the span being sent in the second pass
    std::unordered_set<uint64_t> spans_done_; // block << 40 | span index
    std::vector<WorkingSetRange> record_; // loaded_ (up to the cap), then this resume's
    uint64_t record_pages_ = 0;
    bool added_ = false;        // record_ has pages loaded_ had not
    bool can_record_ = false;   // on, and the directory is writable
    std::optional<std::chrono::steady_clock::time_point> started_;
    std::chrono::steady_clock::time_point last_request_; // from start() on
    // Per block, one bit per page: recorded already; sent as working set
    // and not asked for since.
    std::vector<std::vector<uint64_t>> recorded_, sent_;
    uint64_t sent_pages_ = 0, requested_anyway_ = 0;
};

} // namespace qmigd
