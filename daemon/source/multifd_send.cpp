// MultifdSend, the main thread's side: queueing pages, hand-off to idle senders, sync, shutdown.
#include "daemon/source/multifd_send.h"

#include <cstring>

#include <fmt/format.h>

#include "daemon/migration_threads.h"
#include "daemon/thread_name.h"

namespace qmigd {

MultifdSend::MultifdSend(std::vector<UniqueFd> fds, const std::vector<RAMBlock> &blocks,
                         bool detect_zero, const Uuid &uuid, MappedRamSave *file,
                         MultiFDCompressionParams compression, TlsParams tls)
    : blocks_(blocks), detect_zero_(detect_zero), uuid_(uuid), file_(file),
      compression_(compression), tls_(std::move(tls))
{
    for (size_t i = 0; i < fds.size(); i++) {
        auto s = std::make_unique<Sender>();
        s->id = unsigned(i);
        s->ch = std::make_unique<Channel>(std::move(fds[i]));
        s->data = std::make_unique<AlignedBuffer>(
            size_t(file_ ? MultifdJob::kPackets : 1) * MULTIFD_PACKET_PAGES * TARGET_PAGE_SIZE);
        senders_.push_back(std::move(s));
    }
    MutexLock lk(mu_);
    state_.resize(senders_.size());
}

// The channels close with the senders, after every thread is joined.
MultifdSend::~MultifdSend()
{
    shutdown();
    for (auto &s : senders_) {
        if (s->thread.joinable()) {
            s->thread.join();
        }
    }
}

void MultifdSend::start()
{
    for (auto &sp : senders_) {
        Sender *s = sp.get();
        s->thread = std::thread([this, s] {
            std::string name = "mig/src/send_" + std::to_string(s->id);
            set_thread_name(name);
            ListedMigrationThread listed(name); // query-migrationthreads
            channel_main(*s);
        });
    }
}

std::vector<Channel *> MultifdSend::channels() const
{
    std::vector<Channel *> r;
    for (const auto &s : senders_) {
        r.push_back(s->ch.get());
    }
    return r;
}

void MultifdSend::wake_all()
{
    quit_ = true;
    main_cv_.notify_all();
    for (auto &s : senders_) {
        s->cv.notify_all();
    }
}

void MultifdSend::set_error(const Error &e)
{
    MutexLock lk(mu_);
    if (!error_) {
        error_ = e;
    }
    wake_all();
}

Status MultifdSend::error() const
{
    MutexLock lk(mu_);
    return error_ ? Status(*error_) : Status();
}

void MultifdSend::shutdown()
{
    {
        MutexLock lk(mu_);
        wake_all();
    }
    for (auto &s : senders_) {
        s->ch->shutdown();
    }
}

Status MultifdSend::queue_page(size_t block, uint64_t offset, const uint8_t *data)
{
    MultifdJob *job = pending_.get();
    MultifdPages *p = job->count ? &job->packets[job->count - 1] : nullptr;
    if (!p || p->num == MULTIFD_PACKET_PAGES || p->block != block) {
        if (job->count == MultifdJob::kPackets) {
            QMIGD_TRY(send_pending()); // swaps pending_ with an idle channel's job
            job = pending_.get();
        }
        p = &job->packets[job->count++];
        p->block = block;
        p->num = 0;
        p->with_data = data != nullptr;
    }
    if (data) {
        if (!job->data) {
            job->data = std::make_unique<AlignedBuffer>(size_t(MultifdJob::kPackets) *
                                                        MULTIFD_PACKET_PAGES * TARGET_PAGE_SIZE);
        }
        std::memcpy(job->page_data(job->count - 1, p->num), data, TARGET_PAGE_SIZE);
    }
    p->offset[p->num++] = offset;
    return {};
}

MultifdSend::Sender *MultifdSend::idle_sender()
{
    for (size_t k = 0; k < senders_.size(); k++) {
        Sender *s = senders_[(next_channel_ + k) % senders_.size()].get();
        if (!state_[s->id].pending_job) {
            return s;
        }
    }
    return nullptr;
}

// Hands the pending batch to the next idle channel (round robin from the
// last one used), waiting for one if all are busy.
Status MultifdSend::send_pending()
{
    MutexLock lk(mu_);
    Sender *target = nullptr;
    while (!quit_ && !(target = idle_sender())) {
        lk.wait(main_cv_);
    }
    if (quit_) {
        return error_ ? *error_ : Error("multifd: channels shut down");
    }
    next_channel_ = (target->id + 1) % senders_.size();
    std::swap(state_[target->id].job, pending_);
    pending_->count = 0;
    state_[target->id].pending_job = true;
    target->cv.notify_one();
    return {};
}

bool MultifdSend::synced(const std::vector<uint64_t> &target) const
{
    for (size_t i = 0; i < state_.size(); i++) {
        if (state_[i].syncs_done < target[i]) {
            return false;
        }
    }
    return true;
}

Status MultifdSend::sync()
{
    if (pending_->count > 0) {
        QMIGD_TRY(send_pending());
    }
    MutexLock lk(mu_);
    std::vector<uint64_t> target(senders_.size());
    for (auto &s : senders_) {
        target[s->id] = state_[s->id].syncs_done + 1;
        state_[s->id].pending_sync = true;
        s->cv.notify_one();
    }
    while (!quit_ && !synced(target)) {
        lk.wait(main_cv_);
    }
    if (quit_) {
        return error_ ? *error_ : Error("multifd: channels shut down");
    }
    return {};
}

void MultifdSend::terminate_tls()
{
    MutexLock lk(mu_); // the channels' sessions are ours while they idle
    for (auto &s : senders_) {
        const SenderState &st = state_[s->id];
        if (s->ch->tls() && !st.pending_job && !st.pending_sync) {
            s->ch->tls()->bye();
        }
    }
}

uint64_t MultifdSend::bytes() const
{
    uint64_t sum = 0;
    for (const auto &s : senders_) {
        sum += s->bytes.load(std::memory_order_relaxed);
    }
    return sum;
}

uint64_t MultifdSend::normal_pages() const
{
    uint64_t sum = 0;
    for (const auto &s : senders_) {
        sum += s->normal.load(std::memory_order_relaxed);
    }
    return sum;
}

uint64_t MultifdSend::zero_pages() const
{
    uint64_t sum = 0;
    for (const auto &s : senders_) {
        sum += s->zero.load(std::memory_order_relaxed);
    }
    return sum;
}

} // namespace qmigd
