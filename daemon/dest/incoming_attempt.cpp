// IncomingAttempt: the channels the loop hands it, and its load thread (the
// main channel through the loader, into the images), which starts and joins
// the receive threads (multifd_recv.cpp); its postcopy is in
// postcopy_attempt.cpp, its parking in incoming_park.cpp.
#include "daemon/dest/incoming_attempt.h"

#include <sys/socket.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/dest/image_load_handler.h"
#include "daemon/socket_io.h"
#include "daemon/thread_name.h"

namespace qmigd {

size_t IncomingAttempt::multifd_arrived() const
{
    size_t have = 0;
    for (const auto &ch : multifd_) {
        have += ch ? 1 : 0;
    }
    return have;
}

Status IncomingAttempt::add_multifd(size_t id, std::unique_ptr<Channel> &ch)
{
    if (multifd_[id]) {
        return Error(fmt::format("multifd: received id '{}' already setup'", id));
    }
    multifd_[id] = Accepted{std::move(ch), {}};
    return {};
}

bool IncomingAttempt::channels_complete() const
{
    return main_ && multifd_arrived() == multifd_.size();
}

void IncomingAttempt::start_load()
{
    // mapped-ram never sends MULTIFD_FLUSH: its multifd is the file readers.
    bool channels = !multifd_.empty();
    load_cfg_ = LoadvmConfig{};
    load_cfg_.machine_type = params_.machine_type;
    load_cfg_.blocks = ram_block_descs(blocks_);
    load_cfg_.multifd = channels;
    load_cfg_.mapped_ram = params_.mapped_ram;
    load_cfg_.ignore_shared = params_.ignore_shared;
    load_cfg_.uuid = params_.uuid;
    load_cfg_.park = !params_.park_dir.empty();
    load_cfg_.postcopy_ram = params_.postcopy_ram;
    if (params_.postcopy_ram && !load_cfg_.park) {
        for (const auto &b : blocks_) {
            received_.push_back(std::make_unique<ReceivedBitmap>(b.image->pages()));
        }
    }
    sync_ = channels ? std::make_unique<MultifdRecvSync>(multifd_.size()) : nullptr;
    set_link_timeout(main_->ch->fd(), params_.link_timeout_ms);
    for (const auto &ch : multifd_) {
        set_link_timeout(ch->ch->fd(), params_.link_timeout_ms);
    }
    load_thread_ = std::thread([this] {
        set_thread_name("mig/dst/main");
        load_thread_main();
    });
}

void IncomingAttempt::join_load()
{
    if (load_thread_.joinable()) {
        load_thread_.join();
    }
}

void IncomingAttempt::quit()
{
    if (child_) {
        child_->kill_now(); // the daemon quits: so does the command, all of it
    }
    if (load_thread_.joinable()) {
        abort_with(Error("daemon shutting down"));
        load_thread_.join();
    }
}

void IncomingAttempt::load_thread_main()
{
    for (size_t i = 0; i < multifd_.size(); i++) {
        recv_threads_.emplace_back([this, i] {
            set_thread_name("mig/dst/recv_" + std::to_string(i));
            recv_thread_main(i);
        });
    }
    FdInputStream in(*main_->ch, main_->prefix);
    QEMUFileReader f(in, 256 * 1024);
    ImageLoadHandler::Announce announce;
    if (load_cfg_.park) {
        announce = [this](const std::vector<RamBlockDesc> &d) { return park_announce(d); };
    }
    ImageLoadHandler handler(blocks_, sync_.get(), params_.mapped_ram ? &file_in_ : nullptr,
                             std::move(announce), [this] { return open_return_path(); }, rp_);
    watch_postcopy(handler);
    LoadvmSession session(load_cfg_, handler);
    auto result = load_postcopy(session, handler, session.load(f));
    if (result) {
        if (Status st = check_packets(); !st) {
            result = st.error();
        }
    }
    std::optional<ParkedVm> parked = end_stream(result, handler);
    bytes_.fetch_add(f.pos(), std::memory_order_relaxed);
    end_channels(result, handler);
    std::optional<Error> err;
    {
        MutexLock lk(err_mu_);
        err = thread_error_;
    }
    if (rp_) {
        // The verdict, once everything is loaded (and a parked VM durable):
        // QEMU's migration_incoming_state_destroy().
        rp_->shut(!result || err);
        rp_.reset();
    }
    std::string runstate = result ? result->runstate : "inmigrate";
    owner_.post_end(weak_from_this(), err, runstate, std::move(parked));
}

// The stream's OPEN_RETURN_PATH.
Status IncomingAttempt::open_return_path()
{
    auto rp = ReturnPathOut::open(*main_->ch, rp_writes_);
    QMIGD_TRY(rp);
    rp_ = std::move(*rp);
    rp_open_ = true; // abort_with() leaves its write side open from now on
    if (params_.switchover_ack) {
        // loadvm_process_command(): no device needs to hold the
        // switchover, so the ack goes as soon as the return path opens.
        spdlog::info("incoming migration: switchover acknowledged");
        return rp_->switchover_ack();
    }
    return {};
}

// After the stream: the last pages flushed and, parking, the VM made
// durable (returned for the loop's query); a failure goes into `result`.
std::optional<ParkedVm> IncomingAttempt::end_stream(Result<LoadvmResult> &result,
                                                      ImageLoadHandler &handler)
{
    if (result) {
        if (Status st = handler.flush(); !st) {
            result = st.error();
        }
    }
    std::optional<ParkedVm> parked;
    if (result && load_cfg_.park) {
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
void IncomingAttempt::end_channels(const Result<LoadvmResult> &result,
                                     ImageLoadHandler &handler)
{
    if (result && result->uuid && params_.uuid == Uuid{}) {
        // vmstate_uuid_post_load(): only a warning without a UUID of our own.
        spdlog::warn("UUID is received {}, but local uuid isn't set",
                     uuid_to_string(*result->uuid));
    }
    if (result) {
        normal_pages_.fetch_add(result->normal_pages + handler.file_counts().normal);
        zero_pages_.fetch_add(result->zero_pages + handler.file_counts().zero);
        // Everything the channels carry precedes the last flush; whatever
        // they do now cannot change the outcome.
        loading_done_ = true;
        if (sync_) {
            sync_->abort();
        }
        for (const auto &ch : multifd_) {
            ch->ch->shutdown();
        }
    } else {
        abort_with(result.error());
    }
    for (auto &t : recv_threads_) {
        t.join();
    }
    recv_threads_.clear();
}

void IncomingAttempt::abort_with(const Error &err)
{
    {
        MutexLock lk(park_mu_);
        park_abort_ = true;
    }
    park_cv_.notify_all();
    {
        MutexLock lk(recover_mu_);
        recover_abort_ = true;
    }
    recover_cv_.notify_all();
    {
        MutexLock lk(err_mu_);
        if (!thread_error_) {
            thread_error_ = err;
        }
    }
    if (sync_) {
        sync_->abort();
    }
    // Wake threads blocked in read(); fds stay open until finish(). A
    // pipe cannot be shut down: its writer, the exec: command, goes. With
    // a return path the main socket's write side stays open for the SHUT,
    // unless the load thread is blocked writing it (a source that does not
    // read): rp_writes_ ends that write and bounds the SHUT's.
    if (main_) {
        MutexLock lk(recover_mu_);
        Channel *ch = current_main();
        if (rp_open_) {
            ::shutdown(ch->fd(), SHUT_RD);
            rp_writes_.abort();
        } else {
            ch->shutdown();
        }
    }
    if (child_) {
        child_->terminate(); // set before the threads started, reset after
    }
    shutdown_side_channels();
}

void IncomingAttempt::shutdown_side_channels()
{
    {
        MutexLock lk(preempt_mu_);
        if (preempt_) {
            preempt_->shutdown();
        }
    }
    for (const auto &ch : multifd_) {
        if (ch) {
            ch->ch->shutdown();
        }
    }
}

} // namespace qmigd
