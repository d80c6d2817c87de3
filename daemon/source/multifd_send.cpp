#include "daemon/source/multifd_send.h"

#include <cstring>
#include <sys/uio.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/socket_io.h"
#include "daemon/thread_name.h"
#include "protocol/multifd_packet.h"
#include "ramstate/zero_page.h"

namespace qmigd {

MultifdSend::MultifdSend(std::vector<int> fds, const std::vector<RAMBlock> &blocks,
                         bool detect_zero, const Uuid &uuid, MappedRamSave *file,
                         MultiFDCompressionParams compression, TlsParams tls)
    : blocks_(blocks), detect_zero_(detect_zero), uuid_(uuid), file_(file),
      compression_(compression), tls_(std::move(tls))
{
    for (size_t i = 0; i < fds.size(); i++) {
        auto ch = std::make_unique<Channel>();
        ch->id = unsigned(i);
        ch->fd = fds[i];
        ch->data = std::make_unique<AlignedBuffer>(
            size_t(file_ ? MultifdJob::kPackets : 1) * MULTIFD_PACKET_PAGES * TARGET_PAGE_SIZE);
        channels_.push_back(std::move(ch));
    }
}

MultifdSend::~MultifdSend()
{
    shutdown();
    for (auto &ch : channels_) {
        if (ch->thread.joinable()) {
            ch->thread.join();
        }
        ::close(ch->fd);
    }
}

void MultifdSend::start()
{
    for (auto &ch : channels_) {
        Channel *c = ch.get();
        c->thread = std::thread([this, c] {
            set_thread_name("mig/src/send_" + std::to_string(c->id));
            channel_main(*c);
        });
    }
}

Error multifd_peer_closed_hint(Error e)
{
    const std::string &m = e.message();
    if (m.find("multifd on at both ends") != std::string::npos) {
        return e; // said already, by the channel that failed first
    }
    if (m.find("Connection reset") != std::string::npos ||
        m.find("Broken pipe") != std::string::npos) {
        return Error(m + " (the destination closed the multifd channels: is multifd on at "
                         "both ends?)");
    }
    return e;
}

static Error multifd_channel_error(const Error &e, uint32_t id)
{
    return multifd_peer_closed_hint(Error(e).prepend(fmt::format("multifd channel {}: ", id)));
}

void MultifdSend::set_error(const Error &e)
{
    std::lock_guard<std::mutex> lk(mu_);
    if (!error_) {
        error_ = e;
    }
    quit_ = true;
    main_cv_.notify_all();
    for (auto &ch : channels_) {
        ch->cv.notify_all();
    }
}

Status MultifdSend::error() const
{
    std::lock_guard<std::mutex> lk(mu_);
    return error_ ? Status(*error_) : Status();
}

void MultifdSend::shutdown()
{
    {
        std::lock_guard<std::mutex> lk(mu_);
        quit_ = true;
        main_cv_.notify_all();
        for (auto &ch : channels_) {
            ch->cv.notify_all();
        }
    }
    for (auto &ch : channels_) {
        shutdown_fd(ch->fd);
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

// Hands the pending batch to the next idle channel (round robin from the
// last one used), waiting for one if all are busy.
Status MultifdSend::send_pending()
{
    std::unique_lock<std::mutex> lk(mu_);
    Channel *target = nullptr;
    main_cv_.wait(lk, [&] {
        if (quit_) {
            return true;
        }
        for (size_t k = 0; k < channels_.size(); k++) {
            Channel *c = channels_[(next_channel_ + k) % channels_.size()].get();
            if (!c->pending_job) {
                target = c;
                return true;
            }
        }
        return false;
    });
    if (quit_) {
        return error_ ? *error_ : Error("multifd: channels shut down");
    }
    next_channel_ = (target->id + 1) % channels_.size();
    std::swap(target->job, pending_);
    pending_->count = 0;
    target->pending_job = true;
    target->cv.notify_one();
    return {};
}

Status MultifdSend::sync()
{
    if (pending_->count > 0) {
        QMIGD_TRY(send_pending());
    }
    std::unique_lock<std::mutex> lk(mu_);
    std::vector<uint64_t> target(channels_.size());
    for (auto &ch : channels_) {
        target[ch->id] = ch->syncs_done + 1;
        ch->pending_sync = true;
        ch->cv.notify_one();
    }
    main_cv_.wait(lk, [&] {
        if (quit_) {
            return true;
        }
        for (auto &ch : channels_) {
            if (ch->syncs_done < target[ch->id]) {
                return false;
            }
        }
        return true;
    });
    if (quit_) {
        return error_ ? *error_ : Error("multifd: channels shut down");
    }
    return {};
}

Status MultifdSend::packet_pages(Channel &ch, const MultifdJob &job, uint32_t packet,
                                 const uint8_t **where)
{
    const MultifdPages &pages = job.packets[packet];
    if (pages.with_data) {
        for (uint32_t i = 0; i < pages.num; i++) {
            where[i] = job.page_data(packet, i);
        }
        return {};
    }
    if (ch.zero_copy) {
        // Zero copy sends from the guest's memory itself, whatever page
        // path reads use: a copy in our buffer would have to stay put
        // until the kernel is done with it.
        const RamImage &img = *blocks_[pages.block].image;
        for (uint32_t i = 0; i < pages.num; i++) {
            where[i] = img.host(pages.offset[i]);
        }
        return {};
    }
    // A whole job's pages stay readable at once with mapped-ram (its
    // buffer has a slot per packet); a socket sends each packet in turn.
    uint8_t *buf = ch.data->get() +
                   (file_ ? size_t(packet) * MULTIFD_PACKET_PAGES * TARGET_PAGE_SIZE : 0);
    return blocks_[pages.block].image->load_pages(pages.offset, pages.num, buf, where);
}

// mapped-ram: a job's pages go to their places in the file, zero pages
// nowhere (multifd_send_zero_page_detect + file_write_ramblock_iov), all of
// its packets at once: a run of pages across packets is one write, and a
// disk request costs about what 256 KiB does (MappedRamSave::kZeroGapPages).
Status MultifdSend::write_file_job(Channel &ch, const MultifdJob &job)
{
    constexpr uint32_t kMax = MultifdJob::kPackets * MULTIFD_PACKET_PAGES;
    const uint8_t *where[kMax];
    uint64_t offsets[kMax];
    uint32_t n = 0, normal = 0;
    for (uint32_t k = 0; k < job.count; k++) {
        const MultifdPages &pages = job.packets[k];
        if (n && pages.block != job.packets[k - 1].block) {
            QMIGD_TRY(file_->write_pages(ch.fd, job.packets[k - 1].block, offsets, where, n));
            n = 0;
        }
        QMIGD_TRY(packet_pages(ch, job, k, where + n));
        for (uint32_t i = 0; i < pages.num; i++, n++) {
            offsets[n] = pages.offset[i];
            if (detect_zero_ && RamImage::is_zero_page(where[n])) {
                where[n] = nullptr; // its bit is cleared, nothing written for it
                ch.zero.fetch_add(1, std::memory_order_relaxed);
            } else {
                normal++;
            }
        }
    }
    if (n) {
        QMIGD_TRY(file_->write_pages(ch.fd, job.packets[job.count - 1].block, offsets, where, n));
    }
    ch.bytes.fetch_add(uint64_t(normal) * TARGET_PAGE_SIZE, std::memory_order_relaxed);
    ch.normal.fetch_add(normal, std::memory_order_relaxed);
    return {};
}

Status MultifdSend::send_packet(Channel &ch, const MultifdJob *job, uint32_t packet,
                                uint32_t flags)
{
    if (file_) { // pages go by write_file_job(); a SYNC is only the wait for idle
        return {};
    }
    const MultifdPages *pages = job ? &job->packets[packet] : nullptr;
    uint8_t header[MULTIFD_PACKET_HEADER_SIZE];
    uint64_t offsets[MULTIFD_PACKET_PAGES];
    const uint8_t *normal_data[MULTIFD_PACKET_PAGES];
    struct iovec iov[1 + MULTIFD_PACKET_PAGES];
    uint32_t normal = 0, zero = 0, num = pages ? pages->num : 0;
    const RAMBlock *block = num ? &blocks_[pages->block] : nullptr;
    int n = 0;
    iov[n++] = {header, sizeof(header)};

    // Normal pages first, zero pages after them, each in scan order. Page
    // bytes are sent from wherever load_pages() left them (the mapping or
    // ch.data): one iovec per contiguous run, or compressed into ch.zbuf.
    if (num) {
        const uint8_t *where[MULTIFD_PACKET_PAGES];
        QMIGD_TRY(packet_pages(ch, *job, packet, where));
        uint64_t zeros[MULTIFD_PACKET_PAGES];
        for (uint32_t i = 0; i < num; i++) {
            if (detect_zero_ && RamImage::is_zero_page(where[i])) {
                zeros[zero++] = pages->offset[i];
                continue;
            }
            offsets[normal] = pages->offset[i];
            normal_data[normal++] = where[i];
        }
        std::copy(zeros, zeros + zero, offsets + normal);
    }
    size_t payload = size_t(normal) * TARGET_PAGE_SIZE;
    if (ch.compressor && job) { // every data packet names the method, SYNC ones do not
        flags |= multifd_method(compression_.method).flag;
    }
    if (ch.compressor && normal) {
        auto z = ch.compressor->compress(normal_data, normal, ch.zbuf.get(),
                                         MULTIFD_COMPRESSED_MAX);
        QMIGD_TRY(z);
        payload = *z;
        iov[n++] = {ch.zbuf.get(), payload};
    } else {
        for (uint32_t i = 0; i < normal; i++) { // the header, on the stack, adjoins no page
            iov_append(iov, &n, normal_data[i], TARGET_PAGE_SIZE);
        }
    }
    multifd_packet_encode(header, flags, packet_num_.fetch_add(1, std::memory_order_relaxed),
                          block ? std::string_view(block->desc.idstr) : std::string_view(),
                          offsets, normal, zero, uint32_t(payload));
    // With zero copy packet_pages() hands out the guest's memory; only the
    // main thread's copies (legacy zero-page detection) go as a plain send:
    // their buffer is reused at once.
    if (ch.zero_copy && normal && !ch.compressor && !pages->with_data) {
        QMIGD_TRY(send_zero_copy(ch, iov, n));
    } else {
        QMIGD_TRY(channel_writev(ch.fd, ch.tls.get(), iov, n));
    }
    ch.bytes.fetch_add(sizeof(header) + payload, std::memory_order_relaxed);
    ch.normal.fetch_add(normal, std::memory_order_relaxed);
    ch.zero.fetch_add(zero, std::memory_order_relaxed);
    return {};
}

Status MultifdSend::send_zero_copy(Channel &ch, struct iovec *iov, int n)
{
    QMIGD_TRY(write_full(ch.fd, iov[0].iov_base, iov[0].iov_len));
    return ch.zero_copy->writev(iov + 1, n - 1);
}

Status MultifdSend::flush_zero_copy(Channel &ch)
{
    bool all_copied = false;
    QMIGD_TRY(ch.zero_copy->flush(&all_copied));
    if (all_copied) {
        zero_copy_missed_.fetch_add(1, std::memory_order_relaxed);
    }
    return {};
}

Status MultifdSend::enable_zero_copy()
{
    if (file_) {
        return {}; // mapped-ram writes files: nothing to pin (QEMU writes them plainly too)
    }
    for (auto &ch : channels_) {
        QMIGD_TRY(ZeroCopySender::enable(ch->fd));
        ch->zero_copy = std::make_unique<ZeroCopySender>(ch->fd);
    }
    return {};
}

// Channel thread, before its first packet: the TLS handshake, the init
// message (sockets only: a file channel has no handshake, nobody reads it
// in order) and the compression stream.
Status MultifdSend::channel_setup(Channel &ch)
{
    if (tls_.enabled()) {
        auto t = TlsSession::client(ch.fd, *tls_.creds, tls_.hostname);
        QMIGD_TRY(t);
        ch.tls = std::move(*t);
    }
    if (compression_.method != MultiFDCompression::None) {
        auto c = multifd_method(compression_.method).make_compressor(compression_.level);
        QMIGD_TRY(c);
        ch.compressor = std::move(*c);
        ch.zbuf.reset(new uint8_t[MULTIFD_COMPRESSED_MAX]);
    }
    if (file_) {
        return {};
    }
    uint8_t init[MULTIFD_INIT_SIZE];
    multifd_init_encode(uuid_, uint8_t(ch.id), init);
    QMIGD_TRY(channel_write(ch.fd, ch.tls.get(), init, sizeof(init)));
    ch.bytes.fetch_add(sizeof(init), std::memory_order_relaxed);
    return {};
}

void MultifdSend::channel_main(Channel &ch)
{
    Status st = channel_setup(ch);
    std::unique_lock<std::mutex> lk(mu_);
    while (st) {
        ch.cv.wait(lk, [&] { return quit_ || ch.pending_job || ch.pending_sync; });
        if (quit_) {
            break;
        }
        if (ch.pending_job) {
            lk.unlock();
            if (file_) {
                st = write_file_job(ch, *ch.job);
            }
            for (uint32_t i = 0; !file_ && i < ch.job->count && st; i++) {
                st = send_packet(ch, ch.job.get(), i, 0);
            }
            lk.lock();
            ch.pending_job = false;
        } else {
            lk.unlock();
            st = send_packet(ch, nullptr, 0, MULTIFD_FLAG_SYNC);
            if (st && ch.zero_copy) {
                st = flush_zero_copy(ch); // multifd_send_sync_main()'s flush
            }
            lk.lock();
            ch.pending_sync = false;
            ch.syncs_done++;
        }
        main_cv_.notify_all();
    }
    lk.unlock();
    if (!st) {
        set_error(multifd_channel_error(st.error(), ch.id));
    }
}

void MultifdSend::terminate_tls()
{
    std::lock_guard<std::mutex> lk(mu_); // the channels' sessions are ours while they idle
    for (auto &ch : channels_) {
        if (ch->tls && !ch->pending_job && !ch->pending_sync) {
            ch->tls->bye();
        }
    }
}

uint64_t MultifdSend::bytes() const
{
    uint64_t sum = 0;
    for (const auto &ch : channels_) {
        sum += ch->bytes.load(std::memory_order_relaxed);
    }
    return sum;
}

uint64_t MultifdSend::normal_pages() const
{
    uint64_t sum = 0;
    for (const auto &ch : channels_) {
        sum += ch->normal.load(std::memory_order_relaxed);
    }
    return sum;
}

uint64_t MultifdSend::zero_pages() const
{
    uint64_t sum = 0;
    for (const auto &ch : channels_) {
        sum += ch->zero.load(std::memory_order_relaxed);
    }
    return sum;
}

} // namespace qmigd
