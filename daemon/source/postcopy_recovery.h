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
#include <mutex>
#include <string>
#include <vector>

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
    void begin();
    // Reader: a RECV_BITMAP message for `idstr`; `read` takes exactly n
    // bytes more off the return path (the bitmap follows the message).
    using Read = std::function<Status(uint8_t *, size_t)>;
    Status recv_bitmap(const std::string &idstr, const Read &read);
    // Reader: RESUME_ACK. Outside a recovery (a duplicate, or one in
    // precopy) it changes nothing and is not an error, as in QEMU 10.
    Status resume_ack(uint32_t value);
    // Its value, the one thing QEMU 10 checks in any state.
    static Status check_resume_ack(uint32_t value);
    // Reader: it ends, however it ends; the waits below end with it.
    void return_path_ended();
    // Migration thread: until every bitmap came, or the return path ended
    // (its error, or an error saying what never came).
    Status wait_bitmaps(ReturnPathIn &rp);
    Status wait_ack(ReturnPathIn &rp);
    // After wait_bitmaps(): which pages of block i the destination has. A
    // copy, taken under mu_: a duplicate RECV_BITMAP may replace it meanwhile.
    std::vector<uint64_t> received(size_t block);

private:
    Status wait(ReturnPathIn &rp, const std::function<bool()> &done, const char *what);

    const std::vector<RamBlockDesc> blocks_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool active_ = false;                         // protected by mu_
    std::vector<std::vector<uint64_t>> received_; // protected by mu_
    std::vector<bool> got_;                       // protected by mu_
    size_t got_count_ = 0;                        // protected by mu_
    bool acked_ = false;                          // protected by mu_
    bool rp_ended_ = false;                       // protected by mu_; begin() clears it
};

} // namespace qmigd
