// Source multifd: sender threads and the main thread's hand-off to them
// (QEMU's multifd_send_state / MultiFDSendParams).
//
// The main migration thread queues pages into `pending_` (packet-sized
// batches, one RAMBlock each) and hands a full batch to an idle channel by
// swapping buffers; the channel thread detects zero pages (zero-page-
// detection=multifd), builds the 1344-byte header and sends header + pages
// with one writev, from the image's mapping or from the channel's buffer,
// whichever page path the image uses (ramstate/page_path.h).
//
// With multifd-compression each channel thread also runs one compression
// stream over its packets' normal pages (protocol/multifd_compress.h).
//
// With mapped-ram the channels are descriptors of the migration file, not
// sockets: no init message, no packet headers and no SYNC packets; a
// channel writes its normal pages at their fixed offsets and a sync only
// waits until every channel is idle (QEMU's MULTIFD_SYNC_LOCAL).
//
// multifd_send.cpp holds the main thread's side (queueing, hand-off, sync,
// shutdown), multifd_send_channel.cpp the sender threads' (packets, TLS,
// compression, zero copy, mapped-ram writes).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "daemon/channel.h"
#include "daemon/io/unique_fd.h"
#include "daemon/io/zero_copy.h"
#include "daemon/source/mapped_ram_save.h"
#include "daemon/ram_blocks.h"
#include "daemon/thread_safety.h"
#include "daemon/tls/tls_session.h"
#include "protocol/error.h"
#include "protocol/multifd_compress.h"
#include "ramstate/page_buffer.h"

namespace qmigd {

// A packet's worth of queued pages of one block.
struct MultifdPages {
    size_t block = 0;
    uint32_t num = 0;
    // The pages' bytes came with them (in the job's data): the main thread
    // read them already for legacy zero-page detection.
    bool with_data = false;
    uint64_t offset[MULTIFD_PACKET_PAGES];
};

// What one hand-off gives a channel: several packets, so a channel thread
// wakes once per job, not once per 128 pages. Wake-ups dominate where
// packets are cheap (all-zero ranges of a sparse guest: a 1 TiB guest is 2
// million packets) on virtual machines where a context switch costs ~10 us.
struct MultifdJob {
    static constexpr uint32_t kPackets = 8;
    uint32_t count = 0; // packets in use; the last may be partly filled
    MultifdPages packets[kPackets];
    // Page bytes of packets with_data, packet k's page i at slot
    // k * MULTIFD_PACKET_PAGES + i. Allocated on first use and kept: only a
    // migration with legacy zero-page detection on the File path needs it.
    std::unique_ptr<AlignedBuffer> data;
    uint8_t *page_data(uint32_t packet, uint32_t i) const
    {
        return data->get() + (size_t(packet) * MULTIFD_PACKET_PAGES + i) * TARGET_PAGE_SIZE;
    }
};

class MultifdSend {
public:
    // `file`: the mapped-ram layout when fds are files; null for sockets.
    // The channels are ours: closed once the sender threads are joined.
    MultifdSend(std::vector<UniqueFd> fds, const std::vector<RAMBlock> &blocks, bool detect_zero,
                const Uuid &uuid, MappedRamSave *file = nullptr,
                MultiFDCompressionParams compression = {}, TlsParams tls = {});
    ~MultifdSend();

    // zero-copy-send: MSG_ZEROCOPY on every channel (daemon/io/zero_copy.h),
    // before start(); QEMU's error where the kernel or socket cannot.
    Status enable_zero_copy();
    // Spawns the channel threads; each sends its init message at once.
    void start();
    // The channels, for the owner's shutdown on cancel (Channel::shutdown()
    // is for any thread); valid while this object lives.
    std::vector<Channel *> channels() const;

    // --- main migration thread only ---
    // Queues a page; hands the job to a channel when its packets are full
    // (a packet ends when full or when the block changes). `data`: the
    // page's bytes, already read by the caller (copied, so a page is read
    // from the image once); null lets the channel read it. One migration
    // passes data for every page or for none.
    Status queue_page(size_t block, uint64_t offset, const uint8_t *data = nullptr);
    // Sends the partial batch, a SYNC on every channel, and waits until every
    // channel has written its SYNC (the caller writes MULTIFD_FLUSH after:
    // the deadlock rule of the wire-format doc, 3.6).
    Status sync() EXCLUDES(mu_);

    // After the last sync, channels idle: ends each channel's TLS session
    // with close_notify. QEMU 10 destinations take a multifd channel that
    // ends without one for a failure (multifd-clean-tls-termination).
    void terminate_tls() EXCLUDES(mu_);

    // --- any thread ---
    // Wakes and stops every channel thread (idempotent); fds are shut down.
    void shutdown() EXCLUDES(mu_);
    Status error() const EXCLUDES(mu_);

    uint64_t bytes() const;
    uint64_t normal_pages() const;
    uint64_t zero_pages() const;
    // dirty-sync-missed-zero-copy: channel syncs after which every
    // zero-copy send had been copied by the kernel all the same.
    uint64_t zero_copy_missed() const { return zero_copy_missed_.load(std::memory_order_relaxed); }

private:
    // One sender (QEMU's MultiFDSendParams): its channel and thread.
    struct Sender {
        unsigned id = 0; // set at construction, read-only after
        // Created by the constructor, destroyed after the thread's join;
        // its TLS session set by the sender thread before its first write,
        // ended by main once the sender idles (terminate_tls).
        std::unique_ptr<Channel> ch;
        std::thread thread; // started by start(), joined by the destructor
        std::condition_variable cv; // the sender waits here for work
        // Sender thread only (allocated by the constructor): the packet's
        // page data on the File path (page-aligned: O_DIRECT writes it as
        // it is); a whole job's with mapped-ram, which writes a job at once.
        std::unique_ptr<AlignedBuffer> data;
        // Sender thread only, with compression: the stream and its output.
        std::unique_ptr<MultiFDCompressor> compressor;
        std::unique_ptr<uint8_t[]> zbuf;
        // With zero-copy-send: made by enable_zero_copy() before start(),
        // the sender thread's after.
        std::unique_ptr<ZeroCopySender> zero_copy;
        // Written by the sender thread, read by main (bytes(), the counters).
        std::atomic<uint64_t> bytes{0};
        std::atomic<uint64_t> normal{0};
        std::atomic<uint64_t> zero{0};
    };

    // What the hand-off tells a sender; protected by mu_ (state_).
    struct SenderState {
        // The sender's job buffer: main swaps its filled pending_ in under
        // mu_ and sets pending_job; the sender takes the pointer under mu_
        // and reads the job without it until it clears pending_job, when
        // the buffer is main's to swap again.
        std::unique_ptr<MultifdJob> job = std::make_unique<MultifdJob>();
        bool pending_job = false;
        bool pending_sync = false;
        uint64_t syncs_done = 0;
    };

    Status send_pending() EXCLUDES(mu_);
    // An idle sender from next_channel_ on, or null.
    Sender *idle_sender() REQUIRES(mu_);
    bool synced(const std::vector<uint64_t> &target) const REQUIRES(mu_);
    void wake_all() REQUIRES(mu_);
    void channel_main(Sender &s) EXCLUDES(mu_);
    // `job`: the sender's job to send, or null for a SYNC packet.
    Status channel_work(Sender &s, const MultifdJob *job);
    Status channel_setup(Sender &s);
    Status send_packet(Sender &s, const MultifdJob *job, uint32_t packet, uint32_t flags);
    // The header as a plain write, then the pages with MSG_ZEROCOPY.
    Status send_zero_copy(Sender &s, struct iovec *iov, int n);
    // A SYNC packet's channel: waits for its zero-copy sends to complete.
    Status flush_zero_copy(Sender &s);
    Status write_file_job(Sender &s, const MultifdJob &job);
    // Where packet `packet` of `job` finds its pages' bytes.
    Status packet_pages(Sender &s, const MultifdJob &job, uint32_t packet,
                        const uint8_t **where);
    void set_error(const Error &e) EXCLUDES(mu_);

    // Set at construction, read-only after (every thread).
    const std::vector<RAMBlock> &blocks_;
    const bool detect_zero_;
    const Uuid uuid_;
    MappedRamSave *const file_;
    const MultiFDCompressionParams compression_;
    const TlsParams tls_;
    // The vector is set at construction and read-only after; each Sender's
    // members say who owns them.
    std::vector<std::unique_ptr<Sender>> senders_;

    mutable Mutex mu_;
    std::condition_variable main_cv_; // main waits here for idle/sync done
    std::vector<SenderState> state_ GUARDED_BY(mu_); // by Sender::id
    bool quit_ GUARDED_BY(mu_) = false;
    std::optional<Error> error_ GUARDED_BY(mu_);
    std::atomic<uint64_t> zero_copy_missed_{0}; // added to by the channel threads

    // Main thread only.
    std::unique_ptr<MultifdJob> pending_ = std::make_unique<MultifdJob>();
    size_t next_channel_ = 0;

    // One sequence for all channels (packet_num), like QEMU.
    std::atomic<uint64_t> packet_num_{0};
};

} // namespace qmigd
