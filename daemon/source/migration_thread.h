// The source's migration thread (QEMU's migration_thread() with
// ram_save_setup/iterate/complete, and postcopy_start()): writes the main channel, walks the
// dirty bitmaps through RamSave (ram_save.h), hands pages to the multifd
// senders, keeps the rate limit, decides switchover and drives
// auto-converge. It shares only MigrationShared with the loop and reaches
// its owner only through MigrationOwner.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "daemon/channel.h"
#include "daemon/io/unique_fd.h"
#include "daemon/source/migration_state.h"
#include "daemon/source/return_path.h"
#include "daemon/migration_status.h"
#include "daemon/source/qemu_file_writer.h"
#include "daemon/ram_blocks.h"
#include "protocol/error.h"
#include "ramstate/guest_control.h"

namespace qmigd {

class MappedRamSave;
class MultifdSend;
class PageRequests;
class PostcopyRecovery;
class PostcopyWorkingSet;
struct PageChannel;
class RamSave;
class XbzrleSave;

// What the migration thread asks of the migration's owner, from the
// migration thread.
class MigrationOwner {
public:
    // A status change, applied on the loop thread if the status is still
    // `from` then (a cancel may have come in between: migrate_set_state()).
    virtual void post_status(MigrationStatus from, MigrationStatus to) = 0;
    // A dirty sync finished round n (the owner tells the monitor).
    virtual void post_pass(uint64_t n) = 0;
    // Un-pauses the guest unless the user paused the VM.
    virtual void resume_guest_if_running() = 0;
    // Every channel the thread writes (main, multifd, preempt), added once
    // it exists (a resume's main channel by the owner, which makes it):
    // cancel, migrate-pause and quit shut it down (Channel::shutdown(), any
    // thread), so that no write to a peer that stopped reading holds the
    // thread; removed by the thread before it is destroyed.
    virtual void add_channel(Channel &ch) = 0;
    virtual void remove_channel(Channel &ch) = 0;

protected:
    ~MigrationOwner() = default;
};

// The migration thread's state and steps. Lives on the migration thread.
class MigrationThread {
public:
    // fds: the main channel, then the multifd channels; ours from here on.
    MigrationThread(const OutgoingParams &p, std::vector<RAMBlock> &blocks,
                    std::vector<UniqueFd> fds,
                    MigrationShared &shared, GuestControl *guest, MigrationOwner &owner);
    ~MigrationThread();

    Status run();

private:
    using Clock = std::chrono::steady_clock;

    uint32_t ram_section_id() const;
    const Uuid *config_uuid() const;
    std::span<const std::string_view> config_caps() const;
    Status migrate(); // run() without the return path's last word
    Status setup();
    Status iterate();
    void update_counters();
    Status sync_if_file();
    Status complete();
    // Switchover's first steps, precopy or postcopy: the guest paused (or
    // left running on failure), status device, downtime counting.
    Status stop_for_switchover(bool *running);
    bool switchover_acked() const;
    Status pause_before_switchover(MigrationStatus from);
    // The device sections (a parked VM's as received); with `eof`, then
    // EOF and the VM description, as precopy ends. Postcopy packages them
    // without.
    void put_device_state(ByteWriter &w, bool running, bool eof);
    void put_iterable_sections(ByteWriter &w, bool setup);
    // Postcopy (source/postcopy.cpp).
    bool postcopy_requested() const;
    Status postcopy_start();
    Status preempt_connect();
    // The postcopy phase to its end, pausing on a failure and going on
    // once `migrate resume=true` brings new channels.
    Status postcopy_run();
    Status postcopy_pause(Error why);
    Status postcopy_resume(std::unique_ptr<Channel> ch);
    Status tls_handshake(Channel &ch);
    void drop_channels();
    Status postcopy_iterate();
    Status postcopy_send_part();
    Status serve_page_requests();
    // A parked VM's working set (after the requests, before the walk);
    // *left: some of it still to send.
    Status send_working_set(const std::function<bool()> &should_yield, bool *left);
    Status postcopy_complete();
    Status send_part(bool *round_done);
    Status send_dirty(bool until_done, bool *round_done);
    uint64_t dirty_sync();
    void end_period();
    void update_xbzrle_rates();
    Status rate_limit_wait();
    void publish();
    Status check_cancel();
    // Bytes written so far: main channel, multifd channels, mapped-ram file.
    uint64_t transferred() const;

    const OutgoingParams p_;
    std::vector<RAMBlock> &blocks_;
    MigrationShared &shared_;
    GuestControl *const guest_; // may be null
    MigrationOwner &owner_;
    // The main channel (its TLS session with tls-creds, after the
    // handshake); replaced by a postcopy recovery. Written by this thread
    // (out_, declared after it), read by the return path's reader (rp_,
    // destroyed first), shut down by the owner (MigrationOwner::add_channel).
    std::unique_ptr<Channel> main_;
    std::unique_ptr<PageRequests> requests_; // with postcopy-ram: from rp_ to us
    std::unique_ptr<PostcopyRecovery> recovery_; // with postcopy-ram: from rp_ to us
    std::unique_ptr<PostcopyWorkingSet> working_set_; // a parked VM's, with postcopy-ram
    // With postcopy-preempt, from the switch on: where requested pages go.
    std::unique_ptr<Channel> preempt_ch_;
    std::unique_ptr<QEMUFileWriter> preempt_out_;
    std::unique_ptr<PageChannel> preempt_;
    std::unique_ptr<ReturnPathIn> rp_;     // with return-path or postcopy, from setup on
    QEMUFileWriter out_;
    // mapped-ram: pages go to fixed places in the file, not into the stream.
    std::unique_ptr<MappedRamSave> file_;
    std::unique_ptr<MultifdSend> multifd_;
    std::unique_ptr<RamSave> ram_; // the bitmaps and the page walk (ram_save.h)
    std::unique_ptr<XbzrleSave> xbzrle_; // with xbzrle, from setup on
    // The counters at the start of the dirty-rate period.
    struct {
        uint64_t sent = 0, cache_miss = 0, pages = 0, bytes = 0;
    } xbzrle_prev_;
    bool downtime_ = false; // VM stopped: records count as downtime bytes
    bool in_postcopy_ = false; // the package went: max-postcopy-bandwidth
    // Rate limit: bytes actually written (main + multifd) may not run ahead
    // of max-bandwidth x time since the reference point. Measuring what was
    // written, not what was queued, keeps the long-run rate exact even though
    // the channels lag the main thread by a few packets.
    bool over_rate();
    uint64_t rate_limit() const;
    Clock::time_point rate_start_;
    uint64_t rate_start_bytes_ = 0;
    uint64_t rate_bw_ = 0; // max-bandwidth the reference point was taken for
    // Bandwidth measurement (migration_update_counters).
    Clock::time_point update_start_;
    uint64_t update_bytes_ = 0;
    uint64_t threshold_ = 0; // bytes that fit in downtime-limit; 0 until measured
    // Dirty-rate period (migration_update_rates) and auto-converge state.
    Clock::time_point period_start_ = Clock::now();
    uint64_t period_xfer_start_ = 0;
    uint64_t period_dirty_pages_ = 0;
    unsigned dirty_rate_high_cnt_ = 0;
    uint64_t last_sync_dirty_ = 0; // dirty pages right after the last sync
};

} // namespace qmigd
