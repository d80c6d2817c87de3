// The destination's side of the loader (protocol/loadvm.h): where the
// pages of the main channel, and of postcopy's preempt channel, go.
// One per channel, used by that channel's thread only.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "daemon/dest/mapped_ram_load.h"
#include "daemon/dest/multifd_recv.h"
#include "daemon/ram_blocks.h"
#include "daemon/dest/return_path.h"
#include "protocol/loadvm.h"
#include "ramstate/received_bitmap.h"

namespace qmigd {

// The destination's side of the loader: pages go into the images. Pages
// of the main channel come one at a time; consecutive ones are gathered and
// stored with one write (a pwrite, or one pre-fault on the mapped path).
// The run is stored before anything that could touch the same pages: a zero
// page, a MULTIFD_FLUSH (after which channels may rewrite them), the end.
class ImageLoadHandler : public LoadvmHandler {
public:
    static constexpr uint32_t kRunPages = 64;

    using Announce = std::function<Status(const std::vector<RamBlockDesc> &)>;

    ImageLoadHandler(std::vector<RAMBlock> &blocks, MultifdRecvSync *sync,
                     const MappedRamFileIn *file, Announce announce,
                     std::function<Status()> open_rp, std::unique_ptr<ReturnPathOut> &rp)
        : blocks_(blocks), sync_(sync), file_(file), announce_(std::move(announce)),
          open_rp_(std::move(open_rp)), rp_(rp), run_(new uint8_t[kRunPages * TARGET_PAGE_SIZE])
    {
    }
    Status open_return_path() override { return open_rp_(); }
    // POSTCOPY_LISTEN: the owner's status becomes postcopy-active.
    void set_on_listen(std::function<void()> f) { on_listen_ = std::move(f); }
    // With postcopy-ram: pages are marked received once in the image, and
    // a recovery's POSTCOPY_RESUME is reported.
    void set_postcopy(std::vector<std::unique_ptr<ReceivedBitmap>> *received,
                      std::function<void()> on_resume)
    {
        received_ = received;
        on_resume_ = std::move(on_resume);
    }
    Status discard_range(size_t block, uint64_t start, uint64_t length) override
    {
        QMIGD_TRY(flush());
        mark(block, start, length, false);
        return {};
    }
    Status send_recv_bitmap(size_t block) override
    {
        QMIGD_TRY(flush());
        if (!received_ || block >= received_->size() || !rp_) {
            return Error("no received bitmap to send");
        }
        const ReceivedBitmap &r = *(*received_)[block];
        return rp_->recv_bitmap(blocks_[block].desc.idstr, r.snapshot(), r.pages());
    }
    Status postcopy_resume() override
    {
        QMIGD_TRY(rp_ ? rp_->resume_ack() : Status(Error("no return path")));
        if (on_resume_) {
            on_resume_();
        }
        return {};
    }
    void postcopy_listening() override
    {
        if (on_listen_) {
            on_listen_();
        }
    }
    Status ping(uint32_t value) override { return rp_->pong(value); }
    Status announce_blocks(const std::vector<RamBlockDesc> &descs) override
    {
        return announce_ ? announce_(descs) : LoadvmHandler::announce_blocks(descs);
    }
    Status mapped_ram_block(size_t block, const MappedRamHeader &h) override
    {
        QMIGD_TRY(flush());
        if (!file_) {
            return Error("mapped-ram is not enabled");
        }
        return mapped_ram_load_block(*file_, blocks_[block], h, &file_counts_);
    }
    const MappedRamCounts &file_counts() const { return file_counts_; }
    Status put_page(size_t block, uint64_t offset, const uint8_t *data) override
    {
        bool extends = run_pages_ && block == run_block_ &&
                       offset == run_offset_ + run_pages_ * TARGET_PAGE_SIZE;
        if (!extends || run_pages_ == kRunPages) {
            QMIGD_TRY(flush());
            run_block_ = block;
            run_offset_ = offset;
        }
        std::memcpy(run_.get() + size_t(run_pages_++) * TARGET_PAGE_SIZE, data, TARGET_PAGE_SIZE);
        return {};
    }
    Status read_page(size_t block, uint64_t offset, uint8_t *out) override
    {
        QMIGD_TRY(flush()); // the page may be in the run still
        return blocks_[block].image->read(offset, out, TARGET_PAGE_SIZE);
    }
    Status zero_page(size_t block, uint64_t offset) override
    {
        QMIGD_TRY(flush());
        QMIGD_TRY(blocks_[block].image->zero_page(offset));
        mark(block, offset, TARGET_PAGE_SIZE, true);
        return {};
    }
    Status multifd_flush() override
    {
        QMIGD_TRY(flush());
        return sync_ ? sync_->main_flush() : Status(Error("multifd is not enabled"));
    }
    Status flush()
    {
        uint32_t n = run_pages_;
        run_pages_ = 0;
        if (n == 0) {
            return {};
        }
        QMIGD_TRY(blocks_[run_block_].image->write(run_offset_, run_.get(),
                                                   size_t(n) * TARGET_PAGE_SIZE));
        mark(run_block_, run_offset_, uint64_t(n) * TARGET_PAGE_SIZE, true);
        return {};
    }

private:
    void mark(size_t block, uint64_t offset, uint64_t len, bool received)
    {
        if (!received_ || block >= received_->size()) {
            return;
        }
        ReceivedBitmap &r = *(*received_)[block];
        if (received) {
            r.set(offset / TARGET_PAGE_SIZE, len / TARGET_PAGE_SIZE);
        } else {
            r.clear(offset / TARGET_PAGE_SIZE, len / TARGET_PAGE_SIZE);
        }
    }

    std::vector<RAMBlock> &blocks_;
    MultifdRecvSync *sync_;
    const MappedRamFileIn *file_; // null unless mapped-ram
    Announce announce_;           // park mode only
    std::function<Status()> open_rp_;
    std::function<void()> on_listen_;
    std::function<void()> on_resume_;
    std::vector<std::unique_ptr<ReceivedBitmap>> *received_ = nullptr;
    std::unique_ptr<ReturnPathOut> &rp_; // set by open_rp_
    MappedRamCounts file_counts_;
    std::unique_ptr<uint8_t[]> run_;
    size_t run_block_ = 0;
    uint64_t run_offset_ = 0;
    uint32_t run_pages_ = 0;
};


} // namespace qmigd
