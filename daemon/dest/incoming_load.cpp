// The destination's migration threads: the load thread (the main
// channel through the loader, into the images; pausing in postcopy, see
// dest/postcopy.cpp), one receive thread per multifd channel, and
// parking a VM's blocks as they come.
#include "daemon/dest/incoming.h"

#include <cstring>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/dest/image_load_handler.h"
#include "daemon/socket_io.h"
#include "daemon/thread_name.h"
#include "protocol/multifd_compress.h"
#include "protocol/multifd_packet.h"
#include "protocol/wire.h"

namespace qmigd {


// One receive channel's state, owned by its thread: the packet buffer of
// the File page path and, with multifd-compression, the stream and its
// input buffer.
struct RecvChannelState {
    std::unique_ptr<uint8_t[]> buf{new uint8_t[MULTIFD_PACKET_PAGES * TARGET_PAGE_SIZE]};
    std::unique_ptr<MultiFDDecompressor> decompressor;
    std::unique_ptr<uint8_t[]> zbuf;
};

// Inflates a packet's compressed payload into its pages' places (the
// runs prepare_pages() gave, page by page in offset order).
static Status receive_compressed(ChannelReader &in, RecvChannelState &ch, const MultiFDPacket &p,
                                 const struct iovec *iov, int niov)
{
    struct iovec z = {ch.zbuf.get(), p.next_packet_size};
    QMIGD_TRY(in.readv(&z, 1));
    uint8_t *pages[MULTIFD_PACKET_PAGES];
    uint32_t n = 0;
    for (int k = 0; k < niov; k++) {
        for (size_t off = 0; off < iov[k].iov_len; off += TARGET_PAGE_SIZE) {
            pages[n++] = static_cast<uint8_t *>(iov[k].iov_base) + off;
        }
    }
    return ch.decompressor->decompress(ch.zbuf.get(), p.next_packet_size, pages, n);
}

// Receives a packet's page data into the image (straight into the
// mapping, or through ch.buf and pwrite: the image's page path), and makes
// its zero pages zero.
static Status receive_packet(ChannelReader &in, RamImage &img, const MultiFDPacket &p,
                             RecvChannelState &ch)
{
    for (uint32_t i = 0; i < p.zero_pages; i++) {
        QMIGD_TRY(img.zero_page(p.offsets[p.normal_pages + i]));
    }
    if (!p.normal_pages) {
        return {};
    }
    struct iovec iov[MULTIFD_PACKET_PAGES];
    int niov = 0;
    QMIGD_TRY(img.prepare_pages(p.offsets.data(), p.normal_pages, ch.buf.get(), iov, &niov));
    if (ch.decompressor) {
        QMIGD_TRY(receive_compressed(in, ch, p, iov, niov));
    } else {
        QMIGD_TRY(in.readv(iov, niov));
    }
    return img.commit_pages(p.offsets.data(), p.normal_pages, ch.buf.get());
}

void IncomingMigration::recv_thread_main(size_t id)
{
    ChannelReader in(run_->multifd_[id]->ch->fd(), run_->multifd_[id]->ch->tls());
    uint8_t header[MULTIFD_PACKET_HEADER_SIZE];
    RecvChannelState ch;
    const MultiFDMethod &method = multifd_method(params_.compression);
    Status st;
    if (params_.compression != MultiFDCompression::None) {
        auto d = method.make_decompressor();
        st = d.status();
        if (d) {
            ch.decompressor = std::move(*d);
            ch.zbuf.reset(new uint8_t[MULTIFD_COMPRESSED_MAX]);
        }
    }
    while (st) {
        auto got = in.read(header, sizeof(header));
        if (!got || *got == 0) {
            if (!got && !run_->loading_done_) {
                st = got.status();
            }
            break; // EOF at a packet boundary: the source is done with us
        }
        const std::vector<RamBlockDesc> *descs = packet_blocks();
        if (!descs) {
            break;
        }
        auto p = multifd_packet_decode(header, *descs, method.flag);
        st = p.status();
        if (st) {
            st = receive_packet(in, *blocks_[p->block].image, *p, ch);
        }
        if (!st) {
            break;
        }
        run_->normal_pages_.fetch_add(p->normal_pages, std::memory_order_relaxed);
        run_->zero_pages_.fetch_add(p->zero_pages, std::memory_order_relaxed);
        run_->bytes_.fetch_add(sizeof(header) + p->data_bytes(), std::memory_order_relaxed);
        if (p->is_sync() && !run_->sync_->channel_sync(id)) {
            break;
        }
    }
    if (!st) {
        abort_with(Error(st.error()).prepend(fmt::format("multifd channel {}: ", id)));
    }
    run_->sync_->channel_closed(id);
}

Status IncomingMigration::park_announce(const std::vector<RamBlockDesc> &descs)
{
    std::vector<RAMBlock> made;
    for (size_t i = 0; i < descs.size(); i++) {
        RamBlockSpec spec;
        spec.name = descs[i].idstr;
        spec.path = parked_block_path(params_.park_dir, i, descs[i].idstr);
        spec.size = descs[i].used_length;
        spec.open = ImageOpen::Create;
        // No vm.json here (park_dir_check): a file of that name is what a
        // park that was killed left, never part of a parked VM.
        if (::unlink(spec.path.c_str()) == 0) {
            spdlog::info("incoming migration: removed {}, left by an unfinished park",
                         spec.path);
        }
        auto b = ram_block_open(spec, false);
        QMIGD_TRY(b);
        b->image->scan_holes();
        made.push_back(std::move(*b));
    }
    QMIGD_TRY(hand_over_blocks(std::move(made)));
    spdlog::info("incoming migration: parking {} RAM blocks in {}", descs.size(),
                 params_.park_dir);
    if (params_.postcopy_ram) {
        for (const auto &b : blocks_) {
            run_->received_.push_back(std::make_unique<ReceivedBitmap>(b.image->pages()));
        }
    }
    {
        MutexLock lk(run_->park_mu_);
        run_->park_descs_ = descs;
        run_->park_ready_ = true;
    }
    run_->park_cv_.notify_all();
    return {};
}

// blocks_ is the daemon's list, which the loop reads (a /metrics scrape
// lists its blocks): the loop appends the new ones, and the load thread
// reads the list once it has (blocks_handed_ under park_mu_ orders the two).
Status IncomingMigration::hand_over_blocks(std::vector<RAMBlock> made)
{
    auto holder = std::make_shared<std::vector<RAMBlock>>(std::move(made));
    post_to_loop([this, holder, run = run_] {
        for (auto &b : *holder) {
            blocks_.push_back(std::move(b));
        }
        {
            MutexLock lk(run->park_mu_);
            run->blocks_handed_ = true;
        }
        run->park_cv_.notify_all();
    });
    MutexLock lk(run_->park_mu_);
    while (!run_->blocks_handed_ && !run_->park_abort_) {
        lk.wait(run_->park_cv_);
    }
    if (!run_->blocks_handed_) {
        return Error("aborted while the parked blocks were handed to the loop");
    }
    return {};
}

const std::vector<RamBlockDesc> *IncomingMigration::packet_blocks()
{
    if (!run_->load_cfg_.park) {
        return &run_->load_cfg_.blocks;
    }
    MutexLock lk(run_->park_mu_);
    while (!run_->park_ready_ && !run_->park_abort_) {
        lk.wait(run_->park_cv_);
    }
    return run_->park_abort_ ? nullptr : &run_->park_descs_;
}

Result<ParkedVm> IncomingMigration::park_finish(LoadvmResult &result)
{
    ParkedVm vm;
    vm.dir = params_.park_dir;
    vm.machine_type = result.machine_type;
    vm.uuid = result.uuid;
    vm.ram_section_id = result.ram_section_id;
    for (const auto &d : run_->park_descs_) {
        vm.blocks.push_back({d.idstr, d.used_length});
    }
    vm.device_state = std::move(result.device_state);
    vm.iterable_state = std::move(result.iterable_state);
    // Durable before the record names them: the record is the commit.
    for (const auto &b : blocks_) {
        QMIGD_TRY(b.image->sync());
    }
    QMIGD_TRY(parked_vm_write(vm));
    spdlog::info("incoming migration: parked VM '{}' in {}: {} RAM blocks, {} bytes of device "
                 "state",
                 wire_text(vm.machine_type), vm.dir, vm.blocks.size(), vm.device_state.size());
    vm.device_state_bytes = vm.device_state.size();
    vm.device_state.clear(); // written; the loop keeps only the summary
    return vm;
}

void IncomingMigration::park_discard()
{
    for (size_t i = 0; i < blocks_.size(); i++) {
        ::unlink(parked_block_path(params_.park_dir, i, blocks_[i].desc.idstr).c_str());
    }
    blocks_.clear();
    run_->parked_.reset();
}

void IncomingMigration::load_thread_main()
{
    for (size_t i = 0; i < run_->multifd_.size(); i++) {
        run_->recv_threads_.emplace_back([this, i] {
            set_thread_name("mig/dst/recv_" + std::to_string(i));
            recv_thread_main(i);
        });
    }
    FdInputStream in(run_->main_->ch->fd(), run_->main_->prefix, run_->main_->ch->tls());
    QEMUFileReader f(in, 256 * 1024);
    ImageLoadHandler::Announce announce;
    if (run_->load_cfg_.park) {
        announce = [this](const std::vector<RamBlockDesc> &d) { return park_announce(d); };
    }
    ImageLoadHandler handler(blocks_, run_->sync_.get(), params_.mapped_ram ? &run_->file_in_ : nullptr,
                             std::move(announce), [this] { return open_return_path(); }, run_->rp_);
    watch_postcopy(handler);
    LoadvmSession session(run_->load_cfg_, handler);
    auto result = load_postcopy(session, handler, session.load(f));
    std::optional<ParkedVm> parked = end_stream(result, handler);
    run_->bytes_.fetch_add(f.pos(), std::memory_order_relaxed);
    end_channels(result, handler);
    std::optional<Error> err;
    {
        MutexLock lk(run_->err_mu_);
        err = run_->thread_error_;
    }
    if (run_->rp_) {
        // The verdict, once everything is loaded (and a parked VM durable):
        // QEMU's migration_incoming_state_destroy().
        run_->rp_->shut(!result || err);
        run_->rp_.reset();
    }
    std::string runstate = result ? result->runstate : "inmigrate";
    post_to_loop([this, err, runstate, parked = std::move(parked), run = run_]() mutable {
        if (run != run_) {
            return; // not this attempt's end (start() waits for it: never)
        }
        run_->parked_ = std::move(parked);
        finish(err, runstate);
    });
}

// The stream's OPEN_RETURN_PATH.
Status IncomingMigration::open_return_path()
{
    auto rp = ReturnPathOut::open(run_->main_->ch->fd(), run_->main_->ch->tls(), run_->rp_writes_);
    QMIGD_TRY(rp);
    run_->rp_ = std::move(*rp);
    run_->rp_open_ = true; // abort_with() leaves its write side open from now on
    if (params_.switchover_ack) {
        // loadvm_process_command(): no device needs to hold the
        // switchover, so the ack goes as soon as the return path opens.
        spdlog::info("incoming migration: switchover acknowledged");
        return run_->rp_->switchover_ack();
    }
    return {};
}

// The status follows the postcopy: active at the package's LISTEN, and
// again once a recovery's first page came.
void IncomingMigration::watch_postcopy(ImageLoadHandler &handler)
{
    if (params_.postcopy_ram) {
        handler.set_postcopy(&run_->received_, [this] {
            post_to_loop([this] {
                if (status_ == MigrationStatus::PostcopyRecover) {
                    set_status(MigrationStatus::PostcopyActive);
                }
            });
        });
    }
    handler.set_on_listen([this] {
        run_->postcopy_listening_ = true;
        spdlog::info("incoming migration: postcopy: the device state is in, the rest of RAM "
                     "follows");
        post_to_loop([this] {
            if (status_ == MigrationStatus::Active) {
                set_status(MigrationStatus::PostcopyActive);
            }
        });
    });
}

// In postcopy a failure pauses: the guest may run at the source's
// destination... and here the stream goes on over a new channel.
Result<LoadvmResult> IncomingMigration::load_postcopy(LoadvmSession &session,
                                                      ImageLoadHandler &handler,
                                                      Result<LoadvmResult> result)
{
    std::unique_ptr<FdInputStream> rin;
    std::unique_ptr<QEMUFileReader> rf;
    for (;;) {
        while (!result && session.in_postcopy()) {
            run_->bytes_.fetch_add(rf ? rf->pos() : 0, std::memory_order_relaxed);
            (void)handler.flush(); // whole pages read so far count as received
            auto ch = postcopy_pause_incoming(result.error());
            if (!ch) {
                result = ch.error();
                break;
            }
            rin = std::make_unique<FdInputStream>((*ch)->fd(), std::vector<uint8_t>{}, nullptr);
            rf = std::make_unique<QEMUFileReader>(*rin, 256 * 1024);
            auto rp = ReturnPathOut::open((*ch)->fd(), nullptr, run_->rp_writes_);
            if (!rp) {
                result = rp.error();
                break;
            }
            run_->rp_ = std::move(*rp);
            result = session.resume(*rf);
        }
        // The preempt channel's pages are in once its reader ends: at the
        // source's end marker when the stream ended well (a page may still
        // be on its way behind the main channel's end), else at once. A
        // migrate-pause meanwhile pauses: a page may be missing.
        if (!end_preempt(bool(result)) || !result) {
            break;
        }
        result = Error("paused by migrate-pause before the postcopy preempt channel's end marker");
    }
    if (rf) {
        run_->bytes_.fetch_add(rf->pos(), std::memory_order_relaxed);
    }
    return result;
}

// After the stream: the last pages flushed and, parking, the VM made
// durable (returned for the loop's query); a failure goes into `result`.
std::optional<ParkedVm> IncomingMigration::end_stream(Result<LoadvmResult> &result,
                                                      ImageLoadHandler &handler)
{
    if (result) {
        if (Status st = handler.flush(); !st) {
            result = st.error();
        }
    }
    std::optional<ParkedVm> parked;
    if (result && run_->load_cfg_.park) {
        auto vm = park_finish(*result);
        if (vm) {
            parked = std::move(*vm);
        } else {
            result = vm.error();
        }
    }
    return parked;
}

// The receive threads end (their channels shut down) and are joined;
// the counts of a load that went well are added.
void IncomingMigration::end_channels(const Result<LoadvmResult> &result,
                                     ImageLoadHandler &handler)
{
    if (result && result->uuid && params_.uuid == Uuid{}) {
        // vmstate_uuid_post_load(): only a warning without a UUID of our own.
        spdlog::warn("UUID is received {}, but local uuid isn't set",
                     uuid_to_string(*result->uuid));
    }
    if (result) {
        run_->normal_pages_.fetch_add(result->normal_pages + handler.file_counts().normal);
        run_->zero_pages_.fetch_add(result->zero_pages + handler.file_counts().zero);
        // Everything the channels carry precedes the last flush; whatever
        // they do now cannot change the outcome.
        run_->loading_done_ = true;
        if (run_->sync_) {
            run_->sync_->abort();
        }
        for (const auto &ch : run_->multifd_) {
            ch->ch->shutdown();
        }
    } else {
        abort_with(result.error());
    }
    for (auto &t : run_->recv_threads_) {
        t.join();
    }
    run_->recv_threads_.clear();
}

void IncomingMigration::abort_with(const Error &err)
{
    {
        MutexLock lk(run_->park_mu_);
        run_->park_abort_ = true;
    }
    run_->park_cv_.notify_all();
    {
        MutexLock lk(run_->recover_mu_);
        run_->recover_abort_ = true;
    }
    run_->recover_cv_.notify_all();
    {
        MutexLock lk(run_->err_mu_);
        if (!run_->thread_error_) {
            run_->thread_error_ = err;
        }
    }
    if (run_->sync_) {
        run_->sync_->abort();
    }
    // Wake threads blocked in read(); fds stay open until finish(). A
    // pipe cannot be shut down: its writer, the exec: command, goes. With
    // a return path the main socket's write side stays open for the SHUT,
    // unless the load thread is blocked writing it (a source that does not
    // read): rp_writes_ ends that write and bounds the SHUT's.
    if (run_->main_) {
        MutexLock lk(run_->recover_mu_);
        Channel *ch = current_main();
        if (run_->rp_open_) {
            ::shutdown(ch->fd(), SHUT_RD);
            run_->rp_writes_.abort();
        } else {
            ch->shutdown();
        }
    }
    if (run_->child_) {
        run_->child_->terminate(); // set before the threads started, reset after
    }
    {
        MutexLock lk(run_->preempt_mu_);
        if (run_->preempt_) {
            run_->preempt_->shutdown();
        }
    }
    for (const auto &ch : run_->multifd_) {
        if (ch) {
            ch->ch->shutdown();
        }
    }
}

} // namespace qmigd
