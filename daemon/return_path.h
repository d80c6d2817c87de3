// The return path of a migration (QEMU's migration.c: the destination's
// migrate_send_rp_*() and the source's source_return_path_thread()): the
// main channel's socket, read the other way. Messages are framed in
// protocol/return_path.h.
//
// Postcopy adds the destination's page requests (daemon/page_requests.h).
// Precopy uses it for the destination's verdict: SHUT(0) once the whole
// stream loaded (a parked VM is durable by then), SHUT(1) when loading
// failed, so that the source fails too instead of reporting `completed`
// for a VM nobody runs; and PONG, the answer to each PING command.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "protocol/error.h"

namespace qmigd {

class PageRequests;
class PeerWriteGuard;
class PostcopyRecovery;
class TlsSession;

// The return path is the main channel's socket read the other way: a file
// or a pipe has none. QEMU's qemu_file_get_return_path() needs a socket too.
Status return_path_check(int fd);

// Destination: what goes back. Used by the load thread only; every write
// goes through `guard`, which the migration's abort ends (a source that
// never reads its return path must not hold the load thread in send()).
class ReturnPathOut {
public:
    // `fd` must be a socket (the return path is its other direction).
    static Result<std::unique_ptr<ReturnPathOut>> open(int fd, TlsSession *tls,
                                                       PeerWriteGuard &guard);
    Status pong(uint32_t value);
    // Postcopy recovery: a block's received bitmap, and RESUME_ACK.
    Status recv_bitmap(const std::string &idstr, const std::vector<uint64_t> &bits,
                       uint64_t pages);
    Status resume_ack();
    // switchover-ack: the source may switch over (no device holds it).
    Status switchover_ack();
    // The verdict; a source that is gone already is not an error here.
    void shut(bool failed);

private:
    ReturnPathOut(int fd, TlsSession *tls, PeerWriteGuard &guard)
        : fd_(fd), tls_(tls), guard_(guard)
    {
    }
    Status send(const std::vector<uint8_t> &msg);

    int fd_;
    TlsSession *tls_;
    PeerWriteGuard &guard_;
};

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
