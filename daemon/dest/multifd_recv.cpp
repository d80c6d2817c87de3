// Multifd receive: the SYNC barrier (multifd_recv.h) and an attempt's receive threads.
#include "daemon/dest/multifd_recv.h"

#include <fmt/format.h>

#include "daemon/dest/incoming_attempt.h"
#include "protocol/multifd_compress.h"
#include "protocol/multifd_packet.h"

namespace qmigd {

bool MultifdRecvSync::channel_sync(size_t ch)
{
    MutexLock lk(mu_);
    uint64_t epoch = ++synced_[ch];
    cv_.notify_all();
    while (!aborted_ && released_ < epoch) {
        lk.wait(cv_);
    }
    return !aborted_;
}

void MultifdRecvSync::channel_closed(size_t ch)
{
    MutexLock lk(mu_);
    closed_[ch] = true;
    cv_.notify_all();
}

Status MultifdRecvSync::main_flush()
{
    MutexLock lk(mu_);
    while (!aborted_ && !all_synced()) {
        lk.wait(cv_);
    }
    if (aborted_) {
        return Error("migration aborted");
    }
    for (size_t ch = 0; ch < synced_.size(); ch++) {
        if (synced_[ch] <= released_) {
            return Error(fmt::format("multifd channel {} closed before sync point {}", ch,
                                     released_ + 1));
        }
    }
    released_++;
    cv_.notify_all();
    return {};
}

bool MultifdRecvSync::all_synced() const
{
    for (size_t ch = 0; ch < synced_.size(); ch++) {
        if (synced_[ch] <= released_ && !closed_[ch]) {
            return false;
        }
    }
    return true;
}

void MultifdRecvSync::abort()
{
    MutexLock lk(mu_);
    aborted_ = true;
    cv_.notify_all();
}

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

void IncomingAttempt::recv_thread_main(size_t id)
{
    ChannelReader in(*multifd_[id]->ch);
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
            if (!got && !loading_done_) {
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
        count_packet(p->packet_num);
        normal_pages_.fetch_add(p->normal_pages, std::memory_order_relaxed);
        zero_pages_.fetch_add(p->zero_pages, std::memory_order_relaxed);
        bytes_.fetch_add(sizeof(header) + p->data_bytes(), std::memory_order_relaxed);
        if (p->is_sync() && !sync_->channel_sync(id)) {
            break;
        }
    }
    if (!st) {
        abort_with(Error(st.error()).prepend(fmt::format("multifd channel {}: ", id)));
    }
    sync_->channel_closed(id);
}

void IncomingAttempt::count_packet(uint64_t packet_num)
{
    packets_.fetch_add(1, std::memory_order_relaxed);
    uint64_t top = top_packet_.load(std::memory_order_relaxed);
    while (packet_num > top &&
           !top_packet_.compare_exchange_weak(top, packet_num, std::memory_order_relaxed)) {
    }
}

// After the stream's end (its last MULTIFD_FLUSH passed every channel's
// last SYNC, so no count moves): a packet number that never came went on a
// connection this destination did not take as a channel, its pages lost.
Status IncomingAttempt::check_packets() const
{
    uint64_t got = packets_.load(), top = top_packet_.load();
    if (got == 0 || got == top + 1) {
        return {};
    }
    return Error(fmt::format("multifd: {} packets arrived, numbered up to {}: the rest went on "
                             "channels this destination does not have, their pages lost",
                             got, top));
}

} // namespace qmigd
