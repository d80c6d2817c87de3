// RamSave: the source's dirty bitmaps, page walk and RAM records.
#include "daemon/source/ram_save.h"

#include <algorithm>
#include <bit>

#include "protocol/mapped_ram.h"
#include "ramstate/zero_page.h"

namespace qmigd {

RamSave::RamSave(std::vector<RAMBlock> &blocks, ZeroPageDetection zpd, QEMUFileWriter &out,
                 MultifdSend *multifd, MappedRamSave *file)
    : blocks_(blocks), zpd_(zpd), out_(out), multifd_(multifd), file_(file),
      main_{out, {}}
{
    uint64_t base = 0;
    for (const auto &b : blocks_) {
        block_base_.push_back(base);
        base += b.desc.used_length;
        descs_.push_back(b.desc);
        bitmaps_.emplace_back((b.image->pages() + 63) / 64, 0);
    }
}

// The MEM_SIZE record. With mapped-ram each block entry is followed by its
// header, and the stream skips the block's pages region: it goes on at
// pages_offset + used_length (mapped_ram_setup_ramblock()).
Status RamSave::put_ram_layout(RamListOptions opts)
{
    ByteWriter &w = out_.w();
    if (!file_) {
        ram_put_mem_size(w, descs_, opts);
        return {};
    }
    ram_put_mem_size_word(w, descs_);
    for (size_t i = 0; i < descs_.size(); i++) {
        ram_put_block_entry(w, descs_[i], opts);
        auto pos = out_.offset();
        QMIGD_TRY(pos);
        const MappedRamHeader &h = file_->place(i, *pos);
        mapped_ram_header_put(w, h);
        QMIGD_TRY(out_.seek(h.pages_offset + descs_[i].used_length));
    }
    return {};
}

uint64_t RamSave::pagesize_summary() const
{
    uint64_t summary = 0;
    for (const auto &d : descs_) {
        summary |= d.page_size;
    }
    return summary;
}

// Bitmap words per page of the block (1 for 4 KiB pages).
static size_t words_per_host_page(const RamBlockDesc &d)
{
    return std::max<size_t>(1, d.page_size / TARGET_PAGE_SIZE / 64);
}

void RamSave::postcopy_chunk_host_pages()
{
    for (size_t i = 0; i < blocks_.size(); i++) {
        size_t k = words_per_host_page(descs_[i]);
        if (k == 1) {
            continue;
        }
        auto &bm = bitmaps_[i];
        for (size_t w = 0; w + k <= bm.size(); w += k) {
            if (std::any_of(bm.begin() + long(w), bm.begin() + long(w + k),
                            [](uint64_t x) { return x != 0; })) {
                for (size_t j = w; j < w + k; j++) {
                    dirty_pages_ += uint64_t(64 - std::popcount(bm[j]));
                    bm[j] = ~uint64_t(0);
                }
            }
        }
    }
}

void RamSave::mark_all_dirty()
{
    if (ignore_all_) {
        return;
    }
    for (size_t i = 0; i < blocks_.size(); i++) {
        uint64_t pages = blocks_[i].image->pages();
        std::fill(bitmaps_[i].begin(), bitmaps_[i].end(), ~uint64_t(0));
        if (pages % 64) {
            bitmaps_[i].back() = (uint64_t(1) << (pages % 64)) - 1;
        }
        dirty_pages_ += pages;
    }
}

uint64_t RamSave::dirty_sync()
{
    uint64_t added = 0;
    for (size_t i = 0; i < blocks_.size() && !ignore_all_; i++) {
        if (!blocks_[i].dirty) {
            continue;
        }
        // Pages written since the last sync are no holes any more.
        RamImage &img = *blocks_[i].image;
        added += blocks_[i].dirty->sync_and_clear(
            bitmaps_[i], [&img](size_t w, uint64_t bits) { img.forget_holes(w, bits); });
    }
    dirty_pages_ += added;
    if (xbzrle_) {
        xbzrle_->on_dirty_sync();
    }
    return added;
}

// End of a pass over all blocks: every page sent so far must land before
// the main channel goes on (SYNC on all channels, then MULTIFD_FLUSH). A
// mapped-ram file has no reader to tell: the channels just finish.
Status RamSave::round_flush()
{
    if (!multifd_) {
        return {};
    }
    QMIGD_TRY(multifd_->sync());
    if (file_) {
        return {};
    }
    ram_put_flag(out_.w(), RAM_SAVE_FLAG_MULTIFD_FLUSH);
    return out_.flush();
}

// Whether load_pages() copies page bytes out of the image (the File path):
// pages the main thread read go to the channels with their bytes, so the
// image is read once. On the Mapped path a read is a pointer, free to redo.
static bool reads_copy(const RAMBlock &b)
{
    return b.image->page_paths().read == PageAccess::File;
}

// Sends the dirty pages of one bitmap word. Pages for multifd zero
// detection go to the channels unread; the main-thread paths (plain precopy,
// legacy zero-page detection) load the word's pages with one call per run.
Status RamSave::send_word(size_t block, size_t word, uint64_t bits)
{
    if (multifd_ && zpd_ != ZeroPageDetection::Legacy) {
        while (bits) {
            uint64_t page = word * 64 + uint64_t(std::countr_zero(bits));
            bits &= bits - 1;
            QMIGD_TRY(multifd_->queue_page(block, page << TARGET_PAGE_BITS));
        }
        return {};
    }
    RAMBlock &b = blocks_[block];
    uint64_t offsets[64];
    const uint8_t *where[64];
    uint32_t n = 0;
    for (; bits; bits &= bits - 1) {
        offsets[n++] = (word * 64 + uint64_t(std::countr_zero(bits))) << TARGET_PAGE_BITS;
    }
    QMIGD_TRY(b.image->load_pages(offsets, n, word_buf_.get(), where));
    if (file_) {
        return save_word_to_file(block, offsets, where, n);
    }
    const bool copied = reads_copy(b);
    for (uint32_t i = 0; i < n; i++) {
        bool zero = zpd_ != ZeroPageDetection::None &&
                    RamImage::is_zero_page(where[i]);
        if (zero) {
            *counter_ += ch_->records.put_zero_page(ch_->out.w(), b.desc, offsets[i]);
            zero_++;
            if (xbzrle_ && xbzrle_->started()) {
                xbzrle_->zero_page(block_base_[block] + offsets[i]);
            }
        } else if (multifd_) {
            QMIGD_TRY(multifd_->queue_page(block, offsets[i], copied ? where[i] : nullptr));
        } else {
            QMIGD_TRY(send_page(block, offsets[i], where[i]));
        }
        QMIGD_TRY(ch_->out.maybe_flush());
    }
    return {};
}

// A page on the main channel: its delta with xbzrle where that applies,
// else whole (ram_save_page()).
Status RamSave::send_page(size_t block, uint64_t offset, const uint8_t *data)
{
    const RamBlockDesc &d = blocks_[block].desc;
    ByteWriter &w = ch_->out.w();
    if (xbzrle_ && xbzrle_->started()) {
        switch (xbzrle_->save(block_base_[block] + offset, &data)) {
        case XbzrleSave::Outcome::Unchanged:
            return {};
        case XbzrleSave::Outcome::Encoded: {
            size_t n = ch_->records.put_xbzrle_page(w, d, offset, xbzrle_->encoded(),
                                                    xbzrle_->encoded_len());
            xbzrle_->counters.bytes += n - 8; // QEMU leaves the header word out
            *counter_ += n;
            return {};
        }
        case XbzrleSave::Outcome::Whole:
            break;
        }
    }
    *counter_ += ch_->records.put_page_header(w, d, offset) + TARGET_PAGE_SIZE;
    w.bytes(data, TARGET_PAGE_SIZE);
    normal_++;
    return {};
}

// mapped-ram, main-thread pages (plain, or legacy zero-page detection):
// zero pages clear their bit (save_zero_page()), the rest go to their
// places in the file or, with multifd, to the channels.
Status RamSave::save_word_to_file(size_t block, const uint64_t *offsets, const uint8_t **where,
                                  uint32_t n)
{
    uint32_t normal = 0;
    uint64_t keep[64];
    const bool copied = reads_copy(blocks_[block]);
    for (uint32_t i = 0; i < n; i++) {
        bool zero = zpd_ == ZeroPageDetection::Legacy &&
                    RamImage::is_zero_page(where[i]);
        if (zero) {
            file_->mark_zero(block, offsets[i]);
            zero_++;
        } else if (multifd_) {
            QMIGD_TRY(multifd_->queue_page(block, offsets[i], copied ? where[i] : nullptr));
        } else {
            keep[normal] = offsets[i];
            where[normal++] = where[i];
        }
    }
    if (normal) {
        QMIGD_TRY(file_->write_pages(out_.channel(), block, keep, where, normal));
        normal_ += normal;
        file_bytes_ += uint64_t(normal) * TARGET_PAGE_SIZE;
        *counter_ += uint64_t(normal) * TARGET_PAGE_SIZE;
    }
    return {};
}

Status RamSave::send_dirty(bool until_done, bool *round_done,
                           const std::function<bool()> &should_yield)
{
    *round_done = false;
    while (cur_block_ < blocks_.size()) {
        auto &bm = bitmaps_[cur_block_];
        // A slice ends between huge pages only: postcopy sends each one
        // whole before anything else.
        const size_t page_words = words_per_host_page(descs_[cur_block_]);
        for (; cur_word_ < bm.size(); cur_word_++) {
            uint64_t bits = bm[cur_word_];
            if (bits == 0) {
                continue;
            }
            bm[cur_word_] = 0;
            dirty_pages_ -= uint64_t(std::popcount(bits));
            QMIGD_TRY(send_word(cur_block_, cur_word_, bits));
            bool page_end = (cur_word_ + 1) % page_words == 0;
            if (!until_done && page_end && should_yield()) {
                cur_word_++;
                return {};
            }
        }
        cur_block_++;
        cur_word_ = 0;
    }
    cur_block_ = 0;
    *round_done = true;
    if (xbzrle_) {
        xbzrle_->start(); // from the second round on (find_dirty_block())
    }
    return round_flush();
}

Status RamSave::send_range(size_t block, uint64_t offset, uint64_t len, PageChannel *urgent)
{
    // The records go to the urgent channel for the while (one thread).
    ch_ = urgent ? urgent : &main_;
    Status st = send_range_on(block, offset, len);
    ch_ = &main_;
    return st;
}

Status RamSave::send_range_on(size_t block, uint64_t offset, uint64_t len)
{
    auto &bm = bitmaps_[block];
    // Whole pages of the block's size, however the request was cut.
    const uint64_t hp = descs_[block].page_size;
    uint64_t start = offset / hp * hp;
    uint64_t stop = (offset + len + hp - 1) / hp * hp;
    uint64_t first = start >> TARGET_PAGE_BITS;
    uint64_t end = std::min<uint64_t>(stop >> TARGET_PAGE_BITS, blocks_[block].image->pages());
    for (uint64_t p = first; p < end;) {
        size_t word = p / 64;
        uint64_t mask = ~uint64_t(0) << (p % 64);
        uint64_t next = (word + 1) * 64;
        if (end < next) {
            mask &= ~(~uint64_t(0) << (end % 64));
        }
        uint64_t bits = bm[word] & mask;
        if (bits) {
            bm[word] &= ~bits;
            dirty_pages_ -= uint64_t(std::popcount(bits));
            QMIGD_TRY(send_word(block, word, bits));
        }
        p = next;
    }
    return {};
}

void RamSave::reload_bitmap(size_t block, const std::vector<uint64_t> &received)
{
    auto &bm = bitmaps_[block];
    uint64_t pages = blocks_[block].image->pages();
    for (size_t w = 0; w < bm.size(); w++) {
        bm[w] = ~(w < received.size() ? received[w] : 0);
    }
    if (pages % 64) {
        bm.back() &= (uint64_t(1) << (pages % 64)) - 1;
    }
}

void RamSave::resume_prepare()
{
    dirty_pages_ = 0;
    for (const auto &bm : bitmaps_) {
        for (uint64_t w : bm) {
            dirty_pages_ += uint64_t(std::popcount(w));
        }
    }
    cur_block_ = 0;
    cur_word_ = 0;
    main_.records.reset();
}

Status RamSave::write_file_bitmaps()
{
    if (!file_) {
        return {};
    }
    auto n = file_->write_bitmaps(out_);
    QMIGD_TRY(n);
    file_bytes_ += *n;
    *counter_ += *n; // downtime bytes by now, as in QEMU
    return {};
}

} // namespace qmigd
