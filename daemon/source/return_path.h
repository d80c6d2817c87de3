// The source's side of the return path (QEMU's source_return_path_thread()):
// a thread that reads what the destination sends back over the main
// channel's socket (framed in protocol/return_path.h): its verdict (SHUT),
// PONGs, postcopy's page requests (source/page_requests.h) and a
// recovery's bitmaps and RESUME_ACK (source/postcopy_recovery.h).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "protocol/error.h"

namespace qmigd {

class PageRequests;
class PostcopyRecovery;
class TlsSession;

// Source: a thread that reads the destination's messages until SHUT.
//
// Thread ownership: the reader thread writes error_ (under mu_) and done_;
// the migration thread reads them through failed() and wait(). The socket
// is the migration's: shutting it down (cancel, failure) ends the reader.
class ReturnPathIn {
public:
    // `requests`: where postcopy's page requests go (null: no postcopy,
    // and a page request is an error); `recovery`: where a resume's
    // bitmaps and acknowledgement go (null: none expected).
    ReturnPathIn(int fd, TlsSession *tls, PageRequests *requests = nullptr,
                 PostcopyRecovery *recovery = nullptr);
    ~ReturnPathIn();
    ReturnPathIn(const ReturnPathIn &) = delete;
    ReturnPathIn &operator=(const ReturnPathIn &) = delete;

    // The error that ended the reader, if it ended with one (any time).
    std::optional<Error> failed();
    // The same, waiting up to `limit` for the reader to end.
    std::optional<Error> failed_within(std::chrono::milliseconds limit);
    // Waits for the reader to end (the destination's SHUT, or the socket
    // shut down); its error if there was one. Every wait on the return
    // path ends when the reader ends, however it ends (QEMU's
    // migration_rp_kick() at the end of its return-path thread).
    Status wait();
    // The reader ended on what the destination sent (a bad message, a page
    // request out of bounds, a failure's SHUT), not on a broken link: a
    // postcopy migration then fails instead of pausing for a recovery.
    bool destination_misbehaved();
    // switchover-ack: the destination said the source may switch over.
    bool switchover_acked() const { return switchover_acked_; }
    // Waits up to `limit` for that, or for the reader's end.
    void wait_switchover_ack(std::chrono::milliseconds limit);

private:
    void run();
    Status read_message(bool *shut);
    Status read(uint8_t *p, size_t n); // notes a broken link

    int fd_;
    TlsSession *tls_;
    PageRequests *const requests_;
    PostcopyRecovery *const recovery_;
    std::mutex mu_;
    std::condition_variable ended_cv_;
    std::optional<Error> error_; // protected by mu_
    bool ended_ = false;         // protected by mu_
    bool misbehaved_ = false;    // protected by mu_
    bool link_failed_ = false;   // reader thread only
    std::atomic<bool> switchover_acked_{false}; // set by the reader under mu_; ended_cv_ told
    std::thread thread_;
};

} // namespace qmigd
