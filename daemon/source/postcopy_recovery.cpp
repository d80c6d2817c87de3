// PostcopyRecovery: a resume's bitmaps and RESUME_ACK, from the reader to the migration thread.
#include "daemon/source/postcopy_recovery.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/source/return_path.h"
#include "protocol/postcopy.h"
#include "protocol/wire.h"

namespace qmigd {

PostcopyRecovery::PostcopyRecovery(std::vector<RamBlockDesc> blocks)
    : blocks_(std::move(blocks)), received_(blocks_.size()), got_(blocks_.size(), false)
{
}

void PostcopyRecovery::begin()
{
    MutexLock lk(mu_);
    active_ = true;
    acked_ = false;
    rp_ended_ = false;
    got_count_ = 0;
    got_.assign(blocks_.size(), false);
}

Status PostcopyRecovery::recv_bitmap(const std::string &idstr, const Read &read)
{
    size_t i = 0;
    while (i < blocks_.size() && blocks_[i].idstr != idstr) {
        i++;
    }
    if (i == blocks_.size()) {
        return Error(fmt::format("MIG_RP_MSG_RECV_BITMAP has invalid block name '{}'",
                                 wire_text(idstr)));
    }
    {
        MutexLock lk(mu_);
        if (!active_) {
            return Error("Reload bitmap in incorrect state postcopy-active");
        }
    }
    const RamBlockDesc &b = blocks_[i];
    const uint64_t pages = b.used_length / TARGET_PAGE_SIZE;
    const uint64_t local_size = recv_bitmap_size(pages);
    uint8_t word[8];
    QMIGD_TRY(read(word, 8));
    if (uint64_t size = get_be64(word); size != local_size) {
        return Error(fmt::format("ramblock '{}' bitmap size mismatch (0x{:x} != 0x{:x})",
                                 wire_text(b.idstr), size, local_size));
    }
    std::vector<uint8_t> le(local_size);
    QMIGD_TRY(read(le.data(), le.size()));
    QMIGD_TRY(read(word, 8));
    if (uint64_t end = get_be64(word); end != RAMBLOCK_RECV_BITMAP_ENDING) {
        return Error(fmt::format("ramblock '{}' end mark incorrect: 0x{:x}", wire_text(b.idstr),
                                 end));
    }
    std::vector<uint64_t> bits(local_size / 8);
    for (size_t w = 0; w < bits.size(); w++) {
        bits[w] = get_le64(le.data() + 8 * w);
    }
    if (pages % 64) { // bits past the block's end mean nothing
        bits.back() &= (uint64_t(1) << (pages % 64)) - 1;
    }
    {
        MutexLock lk(mu_);
        received_[i] = std::move(bits);
        if (!got_[i]) {
            got_[i] = true;
            got_count_++;
        }
    }
    cv_.notify_all();
    return {};
}

std::vector<uint64_t> PostcopyRecovery::received(size_t block)
{
    MutexLock lk(mu_);
    return received_[block];
}

Status PostcopyRecovery::check_resume_ack(uint32_t value)
{
    if (value != MIGRATION_RESUME_ACK_VALUE) {
        return Error(fmt::format("illegal resume_ack value {}", value));
    }
    return {};
}

Status PostcopyRecovery::resume_ack(uint32_t value)
{
    QMIGD_TRY(check_resume_ack(value));
    {
        MutexLock lk(mu_);
        if (!active_) {
            // migrate_handle_rp_resume_ack(): the state moves only from
            // postcopy-recover; any other time the ack is dropped.
            spdlog::info("return path: RESUME_ACK outside a postcopy recovery, ignored");
            return {};
        }
        acked_ = true;
        active_ = false;
    }
    cv_.notify_all();
    return {};
}

void PostcopyRecovery::return_path_ended()
{
    {
        MutexLock lk(mu_);
        rp_ended_ = true;
    }
    cv_.notify_all();
}

bool PostcopyRecovery::arrived(Awaited what) const
{
    return what == Awaited::Bitmaps ? got_count_ == blocks_.size() : acked_;
}

// Pairs with the notify in recv_bitmap(), resume_ack() and
// return_path_ended(): a reader that ends cleanly (the destination's
// SHUT(0)) ends the wait as surely as one that fails.
Status PostcopyRecovery::wait(ReturnPathIn &rp, Awaited what)
{
    {
        MutexLock lk(mu_);
        while (!arrived(what) && !rp_ended_) {
            lk.wait(cv_);
        }
        if (arrived(what)) {
            return {};
        }
    }
    if (auto err = rp.failed()) {
        return *err;
    }
    return Error(fmt::format("the return path ended before the destination sent {}",
                             what == Awaited::Bitmaps ? "its received bitmaps" : "RESUME_ACK"));
}

Status PostcopyRecovery::wait_bitmaps(ReturnPathIn &rp) { return wait(rp, Awaited::Bitmaps); }

Status PostcopyRecovery::wait_ack(ReturnPathIn &rp) { return wait(rp, Awaited::Ack); }

} // namespace qmigd
