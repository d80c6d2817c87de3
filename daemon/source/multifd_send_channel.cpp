// MultifdSend, the sender threads' side: setup, packets, compression, zero copy, mapped-ram writes.
#include "daemon/source/multifd_send.h"

#include <cstring>
#include <sys/uio.h>

#include <fmt/format.h>

#include "daemon/socket_io.h"
#include "protocol/multifd_packet.h"
#include "ramstate/zero_page.h"

namespace qmigd {

static Error multifd_channel_error(const Error &e, uint32_t id)
{
    return Error(e).prepend(fmt::format("multifd channel {}: ", id));
}

Status MultifdSend::packet_pages(Sender &s, const MultifdJob &job, uint32_t packet,
                                 const uint8_t **where)
{
    const MultifdPages &pages = job.packets[packet];
    if (pages.with_data) {
        for (uint32_t i = 0; i < pages.num; i++) {
            where[i] = job.page_data(packet, i);
        }
        return {};
    }
    if (s.zero_copy) {
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
    uint8_t *buf = s.data->get() +
                   (file_ ? size_t(packet) * MULTIFD_PACKET_PAGES * TARGET_PAGE_SIZE : 0);
    return blocks_[pages.block].image->load_pages(pages.offset, pages.num, buf, where);
}

// mapped-ram: a job's pages go to their places in the file, zero pages
// nowhere (multifd_send_zero_page_detect + file_write_ramblock_iov), all of
// its packets at once: a run of pages across packets is one write, and a
// disk request costs about what 256 KiB does (MappedRamSave::kZeroGapPages).
Status MultifdSend::write_file_job(Sender &s, const MultifdJob &job)
{
    constexpr uint32_t kMax = MultifdJob::kPackets * MULTIFD_PACKET_PAGES;
    const uint8_t *where[kMax];
    uint64_t offsets[kMax];
    uint32_t n = 0, normal = 0;
    for (uint32_t k = 0; k < job.count; k++) {
        const MultifdPages &pages = job.packets[k];
        if (n && pages.block != job.packets[k - 1].block) {
            QMIGD_TRY(file_->write_pages(*s.ch, job.packets[k - 1].block, offsets, where, n));
            n = 0;
        }
        QMIGD_TRY(packet_pages(s, job, k, where + n));
        for (uint32_t i = 0; i < pages.num; i++, n++) {
            offsets[n] = pages.offset[i];
            if (detect_zero_ && RamImage::is_zero_page(where[n])) {
                where[n] = nullptr; // its bit is cleared, nothing written for it
                s.zero.fetch_add(1, std::memory_order_relaxed);
            } else {
                normal++;
            }
        }
    }
    if (n) {
        QMIGD_TRY(file_->write_pages(*s.ch, job.packets[job.count - 1].block, offsets, where, n));
    }
    s.bytes.fetch_add(uint64_t(normal) * TARGET_PAGE_SIZE, std::memory_order_relaxed);
    s.normal.fetch_add(normal, std::memory_order_relaxed);
    return {};
}

Status MultifdSend::send_packet(Sender &s, const MultifdJob *job, uint32_t packet,
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
    // s.data): one iovec per contiguous run, or compressed into s.zbuf.
    if (num) {
        const uint8_t *where[MULTIFD_PACKET_PAGES];
        QMIGD_TRY(packet_pages(s, *job, packet, where));
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
    if (s.compressor && job) { // every data packet names the method, SYNC ones do not
        flags |= multifd_method(compression_.method).flag;
    }
    if (s.compressor && normal) {
        auto z = s.compressor->compress(normal_data, normal, s.zbuf.get(),
                                         MULTIFD_COMPRESSED_MAX);
        QMIGD_TRY(z);
        payload = *z;
        iov[n++] = {s.zbuf.get(), payload};
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
    if (s.zero_copy && normal && !s.compressor && !pages->with_data) {
        QMIGD_TRY(send_zero_copy(s, iov, n));
    } else {
        QMIGD_TRY(s.ch->writev(iov, n));
    }
    s.bytes.fetch_add(sizeof(header) + payload, std::memory_order_relaxed);
    s.normal.fetch_add(normal, std::memory_order_relaxed);
    s.zero.fetch_add(zero, std::memory_order_relaxed);
    return {};
}

Status MultifdSend::send_zero_copy(Sender &s, struct iovec *iov, int n)
{
    QMIGD_TRY(write_full(s.ch->fd(), iov[0].iov_base, iov[0].iov_len));
    return s.zero_copy->writev(iov + 1, n - 1);
}

Status MultifdSend::flush_zero_copy(Sender &s)
{
    bool all_copied = false;
    QMIGD_TRY(s.zero_copy->flush(&all_copied));
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
    for (auto &s : senders_) {
        QMIGD_TRY(ZeroCopySender::enable(s->ch->descriptor()));
        s->zero_copy = std::make_unique<ZeroCopySender>(s->ch->descriptor());
    }
    return {};
}

// Channel thread, before its first packet: the TLS handshake, the init
// message (sockets only: a file channel has no handshake, nobody reads it
// in order) and the compression stream.
Status MultifdSend::channel_setup(Sender &s)
{
    if (tls_.enabled()) {
        auto t = TlsSession::client(s.ch->descriptor(), *tls_.creds, tls_.hostname);
        QMIGD_TRY(t);
        s.ch->set_tls(std::move(*t)); // before this thread's first write
    }
    if (compression_.method != MultiFDCompression::None) {
        auto c = multifd_method(compression_.method).make_compressor(compression_.level);
        QMIGD_TRY(c);
        s.compressor = std::move(*c);
        s.zbuf.reset(new uint8_t[MULTIFD_COMPRESSED_MAX]);
    }
    if (file_) {
        return {};
    }
    uint8_t init[MULTIFD_INIT_SIZE];
    multifd_init_encode(uuid_, uint8_t(s.id), init);
    QMIGD_TRY(s.ch->write(init, sizeof(init)));
    s.bytes.fetch_add(sizeof(init), std::memory_order_relaxed);
    return {};
}

// One job's packets, or a SYNC packet (and the zero-copy flush), without the lock.
Status MultifdSend::channel_work(Sender &s, const MultifdJob *job)
{
    if (!job) {
        Status st = send_packet(s, nullptr, 0, MULTIFD_FLAG_SYNC);
        if (st && s.zero_copy) {
            st = flush_zero_copy(s); // multifd_send_sync_main()'s flush
        }
        return st;
    }
    if (file_) {
        return write_file_job(s, *job);
    }
    for (uint32_t i = 0; i < job->count; i++) {
        QMIGD_TRY(send_packet(s, job, i, 0));
    }
    return {};
}

void MultifdSend::channel_main(Sender &s)
{
    Status st = channel_setup(s);
    MutexLock lk(mu_);
    while (st) {
        while (!quit_ && !state_[s.id].pending_job && !state_[s.id].pending_sync) {
            lk.wait(s.cv);
        }
        if (quit_) {
            break;
        }
        const MultifdJob *job = state_[s.id].pending_job ? state_[s.id].job.get() : nullptr;
        lk.unlock();
        st = channel_work(s, job);
        lk.lock();
        if (job) {
            state_[s.id].pending_job = false;
        } else {
            state_[s.id].pending_sync = false;
            state_[s.id].syncs_done++;
        }
        main_cv_.notify_all();
    }
    lk.unlock();
    if (!st) {
        set_error(multifd_channel_error(st.error(), s.id));
    }
}

} // namespace qmigd
