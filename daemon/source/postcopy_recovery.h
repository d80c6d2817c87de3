// The source's side of postcopy recovery (QEMU's postcopy_do_resume(),
// ram_dirty_bitmap_reload() and the RESUME_ACK): after `migrate
// resume=true` brought a new main channel, the destination says which
// pages it has, one RECV_BITMAP answer per block, then acknowledges the
// resume. The return path's reader delivers both; the migration thread
// waits for them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "daemon/thread_safety.h"
#include "protocol/error.h"
#include "protocol/qemu_format.h"

namespace qmigd {

class ReturnPathIn;

// Thread ownership: recv_bitmap(), resume_ack() and return_path_ended()
// run on the return path's reader, begin() and the waits on the migration
// thread (begin() before that reader starts); the bitmaps and flags are
// protected by mu_.
class PostcopyRecovery {
public:
    explicit PostcopyRecovery(std::vector<RamBlockDesc> blocks);

    // Migration thread: a resume starts; every block's bitmap is awaited.
    void begin() EXCLUDES(mu_);
    // Reader: a RECV_BITMAP message for `idstr`; `read` takes exactly n
    // bytes more off the return path (the bitmap follows the message).
    using Read = std::function<Status(uint8_t *, size_t)>;
    Status recv_bitmap(const std::string &idstr, const Read &read) EXCLUDES(mu_);
    // Reader: RESUME_ACK. Outside a recovery (a duplicate, or one in
    // precopy) it changes nothing and is not an error, as in QEMU 10.
    Status resume_ack(uint32_t value) EXCLUDES(mu_);
    // Its value, the one thing QEMU 10 checks in any state.
    static Status check_resume_ack(uint32_t value);
    // Reader: it ends, however it ends; the waits below end with it.
    void return_path_ended() EXCLUDES(mu_);
    // Migration thread: until every bitmap came, or the return path ended
    // (its error, or an error saying what never came).
    Status wait_bitmaps(ReturnPathIn &rp);
    Status wait_ack(ReturnPathIn &rp);
    // After wait_bitmaps(): which pages of block i the destination has. A
    // copy, taken under mu_: a duplicate RECV_BITMAP may replace it meanwhile.
    std::vector<uint64_t> received(size_t block) EXCLUDES(mu_);

private:
    enum class Awaited { Bitmaps, Ack };
    bool arrived(Awaited what) const REQUIRES(mu_);
    Status wait(ReturnPathIn &rp, Awaited what) EXCLUDES(mu_);

    const std::vector<RamBlockDesc> blocks_; // set at construction, read-only after
    mutable Mutex mu_;
    std::condition_variable cv_;
    bool active_ GUARDED_BY(mu_) = false;
    std::vector<std::vector<uint64_t>> received_ GUARDED_BY(mu_);
    std::vector<bool> got_ GUARDED_BY(mu_);
    size_t got_count_ GUARDED_BY(mu_) = 0;
    bool acked_ GUARDED_BY(mu_) = false;
    bool rp_ended_ GUARDED_BY(mu_) = false; // begin() clears it
};

} // namespace qmigd
