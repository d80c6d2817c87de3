// The source's side of the return path (QEMU's source_return_path_thread()):
// a thread that reads what the destination sends back over the main
// channel's socket (framed in protocol/return_path.h): its verdict (SHUT),
// PONGs, postcopy's page requests (source/page_requests.h) and a
// recovery's bitmaps and RESUME_ACK (source/postcopy_recovery.h).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <optional>
#include <thread>

#include "daemon/thread_safety.h"
#include "protocol/error.h"

namespace qmigd {

class Channel;
class PageRequests;
class PostcopyRecovery;

// Source: a thread that reads the destination's messages until SHUT.
//
// Thread ownership: the reader thread writes error_, ended_ and misbehaved_
// (under mu_); the migration thread reads them through failed() and wait().
// The channel is the migration thread's, which destroys this object (and
// so joins the reader) before the channel: the reader alone reads it while
// the migration thread writes it. Shutting it down (cancel, failure) ends
// the reader.
class ReturnPathIn {
public:
    // `requests`: where postcopy's page requests go (null: no postcopy,
    // and a page request is an error); `recovery`: where a resume's
    // bitmaps and acknowledgement go (null: none expected).
    ReturnPathIn(Channel &ch, PageRequests *requests = nullptr,
                 PostcopyRecovery *recovery = nullptr);
    ~ReturnPathIn();
    ReturnPathIn(const ReturnPathIn &) = delete;
    ReturnPathIn &operator=(const ReturnPathIn &) = delete;

    // The error that ended the reader, if it ended with one (any time).
    std::optional<Error> failed() EXCLUDES(mu_);
    // The same, waiting up to `limit` for the reader to end.
    std::optional<Error> failed_within(std::chrono::milliseconds limit) EXCLUDES(mu_);
    // Waits for the reader to end (the destination's SHUT, or the socket
    // shut down); its error if there was one. Every wait on the return
    // path ends when the reader ends, however it ends (QEMU's
    // migration_rp_kick() at the end of its return-path thread).
    Status wait();
    // The reader ended on what the destination sent (a bad message, a page
    // request out of bounds, a failure's SHUT), not on a broken link: a
    // postcopy migration then fails instead of pausing for a recovery.
    bool destination_misbehaved() EXCLUDES(mu_);
    // switchover-ack: the destination said the source may switch over.
    bool switchover_acked() const { return switchover_acked_; }
    // Waits up to `limit` for that, or for the reader's end.
    void wait_switchover_ack(std::chrono::milliseconds limit) EXCLUDES(mu_);

private:
    void run();
    Status read_message(bool *shut);
    Status read(uint8_t *p, size_t n); // notes a broken link

    Channel &ch_; // borrowed: read by the reader thread only
    PageRequests *const requests_;     // set at construction, read-only after
    PostcopyRecovery *const recovery_; // set at construction, read-only after
    Mutex mu_;
    std::condition_variable ended_cv_;
    std::optional<Error> error_ GUARDED_BY(mu_);
    bool ended_ GUARDED_BY(mu_) = false;
    bool misbehaved_ GUARDED_BY(mu_) = false;
    bool link_failed_ = false; // reader thread only
    // Atomic, read without the lock by switchover_acked(); set by the
    // reader under mu_ so that wait_switchover_ack() cannot miss it.
    std::atomic<bool> switchover_acked_{false};
    std::thread thread_; // started by the constructor; joined by wait() or the destructor
};

} // namespace qmigd
