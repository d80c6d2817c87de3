// The source's postcopy (QEMU's postcopy_start(), ram_save_iterate() in
// postcopy and qemu_savevm_state_complete_postcopy()): the migration
// thread's steps once migrate-start-postcopy was given.
//
// At switchover the guest stops here for good: the last dirty sync, a
// RAM_DISCARD for every page dirty again (the destination drops its stale
// copy and waits for the new one), then the device state wrapped in one
// PACKAGED command with LISTEN before it and RUN after it, so that the
// destination's guest runs while the rest of RAM streams behind. From then
// on every page the destination asks for on the return path goes before
// the background walk (on the preempt channel with postcopy-preempt, so
// that it does not queue behind the main channel's), and each page goes
// exactly once: a QEMU destination places it with UFFDIO_COPY, which fails
// on a page already there.
#include "daemon/source/migration_thread.h"

#include <spdlog/spdlog.h>

#include "daemon/source/page_requests.h"
#include "daemon/source/postcopy_recovery.h"
#include "daemon/source/postcopy_working_set.h"
#include "daemon/source/ram_save.h"
#include "daemon/socket_io.h"
#include "daemon/tls/tls_session.h"
#include "protocol/postcopy.h"
#include "protocol/savevm.h"

namespace qmigd {

namespace {

// A PART section ends after this long, as in precopy.
constexpr auto kPostcopySlice = std::chrono::milliseconds(50);

} // namespace

// migration_iteration_run(): once asked, postcopy starts at the next
// iteration in which precopy would not finish anyway.
bool MigrationThread::postcopy_requested() const
{
    return p_.postcopy_ram && shared_.start_postcopy.load();
}

// postcopy_preempt_establish_channel(): a second connection to where the
// main channel goes, made at the switch and before the guest stops (a
// destination takes it by its order, after the main channel). It carries
// bare RAM records; a QEMU destination waits for it before loading the
// package.
Status MigrationThread::preempt_connect()
{
    auto fd = connect_to_peer(main_->descriptor(), p_.link_timeout_ms);
    if (!fd) {
        return Error(fd.error()).prepend("postcopy_start: Failed to establish preempt channel: ");
    }
    preempt_ch_ = std::make_unique<Channel>(std::move(*fd));
    owner_.add_channel(*preempt_ch_); // cancel, migrate-pause and quit shut it too
    set_link_timeout(preempt_ch_->fd(), p_.link_timeout_ms);
    preempt_out_ = std::make_unique<QEMUFileWriter>(*preempt_ch_);
    if (Status st = tls_handshake(*preempt_ch_); !st) {
        return Error(st.error()).prepend("postcopy_start: Failed to establish preempt channel: ");
    }
    preempt_ = std::make_unique<PageChannel>(PageChannel{*preempt_out_, {}});
    spdlog::info("migration: postcopy preempt channel connected");
    return {};
}

Status MigrationThread::postcopy_start()
{
    if (p_.postcopy_preempt) {
        QMIGD_TRY(preempt_connect());
    }
    auto stop_time = Clock::now();
    bool running = false;
    QMIGD_TRY(stop_for_switchover(&running));
    ByteWriter &w = out_.w();
    // ram_postcopy_send_discard_bitmap(): the last sync, then every page
    // still to send is discarded at the destination.
    dirty_sync();
    ram_->postcopy_chunk_host_pages();
    uint64_t discarded = 0;
    for (size_t i = 0; i < blocks_.size(); i++) {
        DiscardRanges ranges =
            postcopy_discard_ranges(ram_->bitmap(i), blocks_[i].image->pages());
        for (const auto &r : ranges) {
            discarded += r.second / TARGET_PAGE_SIZE;
        }
        savevm_put_postcopy_ram_discard(w, blocks_[i].desc.idstr, ranges);
        QMIGD_TRY(out_.maybe_flush());
    }
    savevm_put_ping(w, POSTCOPY_PING_DISCARDED);
    std::vector<uint8_t> package;
    ByteWriter pw(package);
    savevm_put_command(pw, MIG_CMD_POSTCOPY_LISTEN);
    put_device_state(pw, running, false);
    savevm_put_ping(pw, POSTCOPY_PING_PACKAGED);
    savevm_put_command(pw, MIG_CMD_POSTCOPY_RUN);
    // The last point of recovery: once the package may have gone, the
    // destination may run the guest, and this side never resumes it.
    shared_.vm_handed_over = true;
    savevm_put_packaged(w, package);
    savevm_put_ping(w, POSTCOPY_PING_RUNNING);
    QMIGD_TRY(out_.flush());
    shared_.stats.downtime_ms = ms_since(stop_time);
    downtime_ = false;
    in_postcopy_ = true;
    if (xbzrle_) {
        xbzrle_->stop();
    }
    ram_->count_bytes_in(&shared_.stats.postcopy_bytes);
    if (working_set_) {
        working_set_->start();
    }
    owner_.post_status(MigrationStatus::Device, MigrationStatus::PostcopyActive);
    spdlog::info("migration: postcopy started: {} pages discarded at the destination, device "
                 "state {} bytes, downtime {} ms",
                 discarded, package.size(), shared_.stats.downtime_ms.load());
    return {};
}

// Pages the destination asked for, before anything else: each one still
// to send goes now (one already sent is not sent again).
Status MigrationThread::serve_page_requests()
{
    bool sent = false;
    while (auto r = requests_->pop()) {
        spdlog::trace("postcopy: page request block {} offset {:#x} len {}", r->block, r->offset,
                      r->len);
        if (working_set_) {
            working_set_->requested(*r);
            shared_.stats.working_set_requested = working_set_->requested_anyway();
        }
        QMIGD_TRY(ram_->send_range(r->block, r->offset, r->len, preempt_.get()));
        sent = true;
    }
    shared_.stats.postcopy_requests = requests_->count();
    // On the preempt channel they leave at once: nothing queues before them.
    return sent && preempt_out_ ? preempt_out_->flush() : Status();
}

// A parked VM's recorded working set, piece by piece, on the main channel
// until it is all gone or should_yield() says a request came in or the
// slice is over; pages already sent are skipped as for a request.
Status MigrationThread::send_working_set(const std::function<bool()> &should_yield,
                                         bool *left)
{
    *left = true;
    // The spans around the recorded pages go a few pieces at a time, in
    // turn with the walk (postcopy_send_part()).
    int pieces = 0;
    while (!should_yield() && !(working_set_->in_spans() && pieces++ == 4)) {
        auto r = working_set_->next();
        if (!r) {
            *left = false;
            return {};
        }
        working_set_->sending(*r, ram_->bitmap(r->block));
        QMIGD_TRY(ram_->send_range(r->block, r->offset, r->pages * TARGET_PAGE_SIZE));
        shared_.stats.working_set_pages = working_set_->pages_sent();
    }
    return {};
}

// One PART section: requested pages, then a parked VM's working set, then
// the background walk until the slice or the rate window is used up, a
// request comes in, or nothing is left.
Status MigrationThread::postcopy_send_part()
{
    ByteWriter &w = out_.w();
    savevm_put_section_continue(w, QEMU_VM_SECTION_PART, ram_section_id());
    auto slice_start = Clock::now();
    bool slice_over = false;
    auto should_yield = [&] {
        slice_over = Clock::now() - slice_start > kPostcopySlice || over_rate();
        return slice_over || requests_->pending();
    };
    while (!slice_over && ram_->dirty_pages() > 0) {
        QMIGD_TRY(serve_page_requests());
        bool ws_left = false;
        if (working_set_) {
            QMIGD_TRY(send_working_set(should_yield, &ws_left));
        }
        // The recorded pages go before the walk; the spans around them in
        // turn with it, a word of the walk after each few pieces: the walk
        // from the start of RAM brings what a guest touches at once (its
        // kernel's pages), which no record holds since the walk always
        // brought them first.
        if (ws_left && !working_set_->in_spans()) {
            continue;
        }
        if (working_set_ && working_set_->holding_walk()) {
            // While it records: requests and the working set only, each
            // requested page out at once (the guest runs uncontended).
            if (!ws_left) {
                QMIGD_TRY(out_.flush());
                requests_->wait_pending(std::chrono::milliseconds(5));
                slice_over = Clock::now() - slice_start > kPostcopySlice;
            }
            continue;
        }
        bool round_done = false;
        QMIGD_TRY(ram_->send_dirty(false, &round_done,
                                   [&] { return should_yield() || ws_left; }));
    }
    QMIGD_TRY(serve_page_requests());
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    shared_.stats.postcopy_bytes += 8;
    savevm_put_footer(w, ram_section_id());
    return out_.flush();
}

Status MigrationThread::postcopy_iterate()
{
    while (ram_->dirty_pages() > 0) {
        QMIGD_TRY(postcopy_send_part());
        publish();
        QMIGD_TRY(check_cancel());
        QMIGD_TRY(rate_limit_wait());
    }
    return {};
}

// qemu_savevm_state_complete_postcopy(): RAM's END section (nothing is
// left to send in it), then EOF; no VM description follows in postcopy.
// The destination's SHUT says when its guest has every page.
Status MigrationThread::postcopy_complete()
{
    ByteWriter &w = out_.w();
    savevm_put_section_continue(w, QEMU_VM_SECTION_END, ram_section_id());
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    shared_.stats.postcopy_bytes += 8;
    savevm_put_footer(w, ram_section_id());
    put_iterable_sections(w, false);
    if (preempt_out_) {
        // postcopy_preempt_shutdown_file(): the preempt channel's end
        // marker, behind its last page; a destination reads up to it
        // before it closes the channel, so no page on its way is lost.
        ram_put_flag(preempt_out_->w(), RAM_SAVE_FLAG_EOS);
        QMIGD_TRY(preempt_out_->flush());
    }
    w.u8(QEMU_VM_EOF);
    QMIGD_TRY(out_.flush());
    spdlog::info("migration: postcopy sent every page ({} requested by the destination)",
                 requests_->count());
    return {};
}

// migration_thread() in postcopy: a failed channel (a cut link, a
// destination that went away, `migrate-pause`) pauses instead of failing
// (a destination that sends what it must not, or says it failed, fails it),
// since the VM now runs at the destination; `migrate resume=true` goes on
// where the destination says it stands. Only the destination's SHUT ends it.
Status MigrationThread::postcopy_run()
{
    for (;;) {
        Status st = postcopy_iterate();
        if (st) {
            st = postcopy_complete();
        }
        if (st) {
            st = rp_->wait();
        }
        if (st) {
            if (working_set_) {
                working_set_->finish();
            }
            return {};
        }
        if (rp_ && rp_->destination_misbehaved()) {
            return st; // a broken destination, not a broken link: no recovery
        }
        QMIGD_TRY(postcopy_pause(st.error()));
    }
}

// The broken channels are shut down, and closed once new ones replace
// them (the owner may still name the old main one until then).
void MigrationThread::drop_channels()
{
    main_->shutdown();
    rp_.reset(); // joins the reader
    preempt_.reset();
    preempt_out_.reset();
    if (preempt_ch_) {
        owner_.remove_channel(*preempt_ch_);
        preempt_ch_.reset();
    }
}

// postcopy_pause(): until a resume succeeds, or the daemon gives up.
Status MigrationThread::postcopy_pause(Error why)
{
    for (;;) {
        spdlog::error("migration: Detected IO failure for postcopy. Migration paused: {}",
                      why.message());
        {
            MutexLock lk(shared_.resume_mu);
            if (shared_.pause_error.empty()) { // migrate-pause says why first
                shared_.pause_error = why.message();
            }
        }
        drop_channels();
        owner_.post_status(MigrationStatus::PostcopyActive, MigrationStatus::PostcopyPaused);
        owner_.post_status(MigrationStatus::PostcopyRecover, MigrationStatus::PostcopyPaused);
        std::unique_ptr<Channel> ch;
        bool abandoned = false;
        {
            MutexLock lk(shared_.resume_mu);
            while (!shared_.abandon && !shared_.resume_channel) {
                lk.wait(shared_.resume_cv);
            }
            abandoned = shared_.abandon;
            ch = std::move(shared_.resume_channel);
        }
        if (abandoned) {
            if (ch) {
                owner_.remove_channel(*ch); // the owner added it; it closes here
            }
            return why.prepend("postcopy given up while paused: ");
        }
        Status st = postcopy_resume(std::move(ch));
        if (st) {
            owner_.post_status(MigrationStatus::PostcopyRecover, MigrationStatus::PostcopyActive);
            spdlog::info("migration: postcopy resumed: {} pages still to send",
                         ram_->dirty_pages());
            return {};
        }
        why = st.error();
    }
}

// postcopy_do_resume(): on the new main channel (no header: the stream
// goes on), the destination's received bitmaps, then POSTCOPY_RESUME and
// its acknowledgement.
Status MigrationThread::postcopy_resume(std::unique_ptr<Channel> ch)
{
    owner_.remove_channel(*main_);
    main_ = std::move(ch); // the owner added it as it made it
    out_.reconnect(*main_);
    QMIGD_TRY(tls_handshake(*main_));
    recovery_->begin();
    rp_ = std::make_unique<ReturnPathIn>(*main_, requests_.get(), recovery_.get());
    for (const auto &b : blocks_) {
        savevm_put_recv_bitmap(out_.w(), b.desc.idstr);
    }
    QMIGD_TRY(out_.flush());
    QMIGD_TRY(recovery_->wait_bitmaps(*rp_));
    for (size_t i = 0; i < blocks_.size(); i++) {
        ram_->reload_bitmap(i, recovery_->received(i));
    }
    ram_->resume_prepare();
    if (p_.postcopy_preempt) {
        QMIGD_TRY(preempt_connect());
    }
    savevm_put_command(out_.w(), MIG_CMD_POSTCOPY_RESUME);
    QMIGD_TRY(out_.flush());
    return recovery_->wait_ack(*rp_);
}

}  // namespace qmigd
