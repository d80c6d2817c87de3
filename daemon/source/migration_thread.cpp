// MigrationThread: setup, switchover, completion, the run (iterations: migration_iterate.cpp).
#include "daemon/source/migration_thread.h"

#include <bit>
#include <cstring>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/source/mapped_ram_save.h"
#include "daemon/source/multifd_send.h"
#include "daemon/source/page_requests.h"
#include "daemon/source/postcopy_recovery.h"
#include "daemon/source/postcopy_working_set.h"
#include "daemon/source/ram_save.h"
#include "daemon/socket_io.h"
#include "daemon/tls/tls_session.h"
#include "daemon/source/xbzrle_save.h"
#include "protocol/iterable_state.h"
#include "protocol/postcopy.h"
#include "protocol/return_path.h"
#include "protocol/savevm.h"
#include "ramstate/zero_page.h"

namespace qmigd {

namespace {

// Section ids QEMU 10 uses for a -M none guest.
constexpr uint32_t kTimerSectionId = 0;
constexpr uint32_t kRamSectionId = 1;
constexpr uint32_t kGlobalStateSectionId = 3;

// A destination that has multifd off closes the multifd channels it
// accepts (QEMU 10 without a word): the source's write then fails with a
// reset or broken pipe, on a multifd channel or the main one, which alone
// does not say why. Adds the likely reason to such an error.
constexpr const char *kMultifdPeerHint =
    " (the destination closed the multifd channels: is multifd on at both ends?)";

Error with_multifd_peer_hint(Error e)
{
    const std::string &m = e.message();
    if (m.find("Connection reset") != std::string::npos ||
        m.find("Broken pipe") != std::string::npos) {
        return Error(m + kMultifdPeerHint);
    }
    return e;
}

} // namespace

MigrationThread::MigrationThread(const OutgoingParams &p, std::vector<RAMBlock> &blocks,
                                 std::vector<UniqueFd> fds, MigrationShared &shared,
                                 GuestControl *guest, MigrationOwner &owner)
    : p_(p), blocks_(blocks), shared_(shared), guest_(guest), owner_(owner),
      main_(std::make_unique<Channel>(std::move(fds[0]))), out_(*main_)
{
    owner_.add_channel(*main_);
    if (p_.mapped_ram) {
        file_ = std::make_unique<MappedRamSave>(blocks_);
    }
    if (p_.multifd) {
        std::vector<UniqueFd> mfds(std::make_move_iterator(fds.begin() + 1),
                                   std::make_move_iterator(fds.end()));
        multifd_ = std::make_unique<MultifdSend>(
            std::move(mfds), blocks_, p_.zpd == ZeroPageDetection::Multifd, p_.uuid, file_.get(),
            p_.compression, p_.tls);
        for (Channel *ch : multifd_->channels()) {
            owner_.add_channel(*ch);
        }
    }
    ram_ = std::make_unique<RamSave>(blocks_, p_.zpd, out_, multifd_.get(), file_.get());
    ram_->count_bytes_in(&shared_.stats.precopy_bytes);
    if (p_.ignore_shared) {
        ram_->ignore_all_blocks();
    }
}

MigrationThread::~MigrationThread()
{
    rp_.reset(); // its reader is joined before the channel it reads goes
    // The owner forgets every channel before it closes (with its member):
    // a cancel after that must not shut down a number the process reuses.
    // The preempt channel closes only now, after the destination's SHUT: it
    // ends its reader itself.
    owner_.remove_channel(*main_);
    if (multifd_) {
        for (Channel *ch : multifd_->channels()) {
            owner_.remove_channel(*ch);
        }
    }
    if (preempt_ch_) {
        owner_.remove_channel(*preempt_ch_);
    }
}

uint64_t MigrationThread::transferred() const
{
    return out_.bytes_total() + (multifd_ ? multifd_->bytes() : 0) + ram_->file_bytes();
}


// A parked VM keeps the id its first source gave the ram section: its
// device sections are numbered around it.
uint32_t MigrationThread::ram_section_id() const
{
    return p_.parked ? p_.parked->ram_section_id : kRamSectionId;
}

// vmstate_uuid_needed(): with validate-uuid, the VM's UUID if it has one
// (a parked VM's own, else --uuid).
const Uuid *MigrationThread::config_uuid() const
{
    if (!p_.validate_uuid) {
        return nullptr;
    }
    if (p_.parked && p_.parked->uuid) {
        return &*p_.parked->uuid;
    }
    return p_.uuid != Uuid{} ? &p_.uuid : nullptr;
}

// The capabilities the destination must have on too (QEMU's
// vmstate_capabilites: x-ignore-shared and mapped-ram).
std::span<const std::string_view> MigrationThread::config_caps() const
{
    static constexpr std::string_view kBoth[] = {"x-ignore-shared", "mapped-ram"};
    if (p_.ignore_shared && p_.mapped_ram) {
        return kBoth;
    }
    if (p_.ignore_shared) {
        return std::span<const std::string_view>(kBoth, 1);
    }
    if (p_.mapped_ram) {
        return std::span<const std::string_view>(kBoth + 1, 1);
    }
    return {};
}

Status MigrationThread::setup()
{
    if (p_.xbzrle) {
        auto cache = PageCache::create(p_.xbzrle_cache_size, TARGET_PAGE_SIZE);
        QMIGD_TRY(cache);
        xbzrle_ = std::make_unique<XbzrleSave>(std::move(*cache));
        ram_->set_xbzrle(xbzrle_.get());
    }
    if (multifd_) {
        if (p_.zero_copy) {
            QMIGD_TRY(multifd_->enable_zero_copy());
        }
        multifd_->start();
    }
    ByteWriter &w = out_.w();
    savevm_put_header(w);
    savevm_put_configuration(w, p_.machine_type, config_uuid(), config_caps());
    if (p_.return_path || p_.postcopy_ram) {
        // As QEMU's migration_thread(): the destination opens its end, and
        // a PING lines both up.
        QMIGD_TRY(return_path_check(main_->fd()));
        savevm_put_command(w, MIG_CMD_OPEN_RETURN_PATH);
        savevm_put_ping(w, RP_PING_OPEN);
        if (p_.postcopy_ram) {
            requests_ = std::make_unique<PageRequests>(ram_block_descs(blocks_));
            recovery_ = std::make_unique<PostcopyRecovery>(ram_block_descs(blocks_));
            if (p_.parked && p_.working_set.on) {
                working_set_ = std::make_unique<PostcopyWorkingSet>(p_.parked, p_.working_set);
                shared_.stats.working_set = true;
            }
        }
        rp_ = std::make_unique<ReturnPathIn>(*main_, requests_.get(), recovery_.get());
    }
    if (p_.postcopy_ram) {
        // A destination that cannot do postcopy fails now, not at switchover.
        savevm_put_postcopy_advise(w, ram_->pagesize_summary());
    }
    // The first bytes leave at once: a QEMU destination's main loop stalls
    // peeking at a connection until 4 bytes are there (wire-format 7.1).
    QMIGD_TRY(out_.flush());
    savevm_put_section_header(w, QEMU_VM_SECTION_START, ram_section_id(), "ram", 0,
                              RAM_SECTION_VERSION);
    QMIGD_TRY(ram_->put_ram_layout({p_.postcopy_ram, p_.ignore_shared}));
    // Dirty sync 1: every page is to be sent; what the guest marked so far is
    // already covered, so the shared bitmaps start clean.
    ram_->mark_all_dirty();
    dirty_sync();
    // Never-written ranges go out as zero pages without being read. Learnt
    // after the sync: a page written from here on is dirty again.
    for (auto &b : blocks_) {
        b.image->scan_holes();
    }
    QMIGD_TRY(ram_->round_flush());
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, ram_section_id());
    put_iterable_sections(w, true);
    return out_.flush();
}

// A parked VM's iterable sections other than RAM's (its disks' dirty
// bitmaps), where QEMU's handler order puts them: the START ones after
// RAM's setup, the PART and END ones after RAM's end.
void MigrationThread::put_iterable_sections(ByteWriter &w, bool setup)
{
    if (!p_.parked || p_.parked->iterable_state.empty()) {
        return;
    }
    auto sections = iterable_state_split(p_.parked->iterable_state); // checked when read
    for (const auto &s : sections ? *sections : std::vector<IterableSection>{}) {
        if ((s.type == QEMU_VM_SECTION_START) == setup) {
            w.bytes(s.bytes.data(), s.bytes.size());
        }
    }
}

// migration_switchover_prepare() with pause-before-switchover: the VM is
// stopped, the status pre-switchover until migrate-continue (or a cancel).
// Posts left from an earlier migrate-continue are dropped first, as QEMU
// drains its semaphore.
Status MigrationThread::pause_before_switchover(MigrationStatus from)
{
    MutexLock lk(shared_.resume_mu);
    shared_.continue_posts = 0;
    owner_.post_status(from, MigrationStatus::PreSwitchover);
    spdlog::info("migration: paused before switchover, waiting for migrate-continue");
    while (shared_.continue_posts == 0 && !shared_.abandon) {
        lk.wait(shared_.resume_cv);
    }
    if (shared_.abandon) {
        return Error("Switchover is interrupted");
    }
    owner_.post_status(MigrationStatus::PreSwitchover, MigrationStatus::Device);
    return {};
}

Status MigrationThread::stop_for_switchover(bool *running)
{
    if (guest_) {
        // The guest finishes the page in flight and acknowledges; only then
        // does the final dirty sync run, so no write is lost. A guest that
        // does not answer, or a cancel meanwhile, leaves it running.
        Status st = guest_->pause(std::chrono::seconds(5), &shared_.cancel_requested);
        if (!st) {
            owner_.resume_guest_if_running();
            return st;
        }
    }
    // What QEMU's global_state_store() records at switchover: whether the
    // VM runs now (a `stop` or `cont` during the migration counts).
    *running = shared_.vm_running.load();
    downtime_ = true;
    ram_->count_bytes_in(&shared_.stats.downtime_bytes);
    if (xbzrle_) {
        xbzrle_->set_last_stage();
    }
    if (p_.pause_before_switchover) {
        QMIGD_TRY(pause_before_switchover(MigrationStatus::Active));
    } else {
        owner_.post_status(MigrationStatus::Active, MigrationStatus::Device);
    }
    savevm_put_command(out_.w(), MIG_CMD_SWITCHOVER_START);
    return {};
}

void MigrationThread::put_device_state(ByteWriter &w, bool running, bool eof)
{
    if (p_.parked) {
        // Every device section, EOF and the VM description, as received.
        const auto &ds = p_.parked->device_state;
        w.bytes(ds.data(), eof ? ds.size() : p_.parked->device_sections_bytes);
        return;
    }
    savevm_put_timer(w, kTimerSectionId);
    savevm_put_globalstate(w, kGlobalStateSectionId, running ? "running" : "paused");
    if (eof) {
        savevm_put_eof_and_vmdesc(w);
    }
}

Status MigrationThread::complete()
{
    auto stop_time = Clock::now();
    bool running = false;
    QMIGD_TRY(stop_for_switchover(&running));
    ByteWriter &w = out_.w();
    savevm_put_section_continue(w, QEMU_VM_SECTION_END, ram_section_id());
    dirty_sync();
    // Everything left, wrapping as often as needed; send_dirty() ends each
    // pass with the multifd sync, so the last page is followed by one.
    bool round_done = false;
    do {
        QMIGD_TRY(send_dirty(true, &round_done));
    } while (ram_->dirty_pages() > 0);
    // After the channels' last page: ram_save_file_bmap().
    QMIGD_TRY(ram_->write_file_bitmaps());
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, ram_section_id());
    put_iterable_sections(w, false);
    put_device_state(w, running, true);
    QMIGD_TRY(out_.flush());
    shared_.stats.downtime_ms = ms_since(stop_time);
    return {};
}

// A stream that lands in a regular file (file:, or fd: of a file) is on
// stable storage, data and size, before the migration says `completed`:
// the VM's QEMU is usually ended then. One fsync of the inode covers the
// multifd channels' descriptors too, O_DIRECT ones included (their writes
// may still sit in the disk's cache).
Status MigrationThread::sync_if_file()
{
    struct stat st;
    if (fstat(main_->fd(), &st) != 0 || !S_ISREG(st.st_mode)) {
        return {};
    }
    if (::fsync(main_->fd()) != 0) {
        return Error(fmt::format("Could not sync the migration file: {}", std::strerror(errno)));
    }
    return {};
}

Status MigrationThread::run()
{
    Status st = migrate();
    if (!st && rp_ && !shared_.cancel_requested) {
        // A destination that failed says why on the return path and then
        // closes, which the channels may see first (a write error): its
        // verdict, if it comes within a moment, is the better error.
        if (auto verdict = rp_->failed_within(std::chrono::seconds(1))) {
            return *verdict;
        }
    }
    // Only here is it known why the channels ended: after a cancel or a
    // yank they were ours to break, with no peer to blame.
    if (!st && multifd_ && !shared_.cancel_requested && !shared_.yanked) {
        return with_multifd_peer_hint(st.error());
    }
    return st;
}

// With tls-creds, the client's handshake on a channel of ours, before any
// other thread uses it (the return path's reader starts after).
Status MigrationThread::tls_handshake(Channel &ch)
{
    if (!p_.tls.enabled()) {
        return {};
    }
    auto t = TlsSession::client(ch.descriptor(), *p_.tls.creds, p_.tls.hostname);
    QMIGD_TRY(t);
    ch.set_tls(std::move(*t));
    return {};
}

Status MigrationThread::migrate()
{
    QMIGD_TRY(tls_handshake(*main_));
    QMIGD_TRY(setup());
    shared_.stats.setup_time_ms = ms_since(shared_.start_time);
    shared_.stats.expected_downtime_ms = int64_t(p_.downtime_limit_ms);
    owner_.post_status(MigrationStatus::Setup, MigrationStatus::Active);
    if (!p_.stop_first) {
        QMIGD_TRY(iterate());
    }
    if (postcopy_requested()) {
        QMIGD_TRY(postcopy_start());
        QMIGD_TRY(postcopy_run());
    } else {
        QMIGD_TRY(complete());
    }
    if (multifd_) {
        QMIGD_TRY(multifd_->error());
        multifd_->terminate_tls();
        multifd_->shutdown();
    }
    if (rp_) {
        // QEMU's close_return_path_on_source(): the destination's verdict.
        QMIGD_TRY(rp_->wait());
    }
    if (main_->tls()) {
        main_->tls()->bye();
    }
    QMIGD_TRY(sync_if_file());
    publish();
    shared_.stats.remaining_pages = 0;
    shared_.stats.dirty_pages_rate = 0;
    shared_.stats.total_time_ms = ms_since(shared_.start_time);
    int64_t active = shared_.stats.total_time_ms - shared_.stats.setup_time_ms;
    shared_.stats.mbps = active > 0 ? double(transferred()) * 8 / double(active) / 1000 : 0;
    return {};
}

} // namespace qmigd
