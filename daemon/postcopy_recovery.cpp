#include "daemon/postcopy_recovery.h"

#include <chrono>

#include <fmt/format.h>

#include "daemon/return_path.h"
#include "protocol/postcopy.h"
#include "protocol/wire.h"

namespace qmigd {

PostcopyRecovery::PostcopyRecovery(std::vector<RamBlockDesc> blocks)
    : blocks_(std::move(blocks)), received_(blocks_.size()), got_(blocks_.size(), false)
{
}

void PostcopyRecovery::begin()
{
    std::lock_guard<std::mutex> lk(mu_);
    active_ = true;
    acked_ = false;
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
        std::lock_guard<std::mutex> lk(mu_);
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
        std::lock_guard<std::mutex> lk(mu_);
        received_[i] = std::move(bits);
        if (!got_[i]) {
            got_[i] = true;
            got_count_++;
        }
    }
    cv_.notify_all();
    return {};
}

Status PostcopyRecovery::resume_ack(uint32_t value)
{
    if (value != MIGRATION_RESUME_ACK_VALUE) {
        return Error(fmt::format("illegal resume_ack value {}", value));
    }
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (!active_) {
            return Error("RESUME_ACK outside a postcopy recovery");
        }
        acked_ = true;
        active_ = false;
    }
    cv_.notify_all();
    return {};
}

Status PostcopyRecovery::wait(ReturnPathIn &rp, const std::function<bool()> &done)
{
    std::unique_lock<std::mutex> lk(mu_);
    while (!done()) {
        cv_.wait_for(lk, std::chrono::milliseconds(50));
        if (!done()) {
            lk.unlock();
            if (auto err = rp.failed()) {
                return *err;
            }
            lk.lock();
        }
    }
    return {};
}

Status PostcopyRecovery::wait_bitmaps(ReturnPathIn &rp)
{
    return wait(rp, [this] { return got_count_ == blocks_.size(); });
}

Status PostcopyRecovery::wait_ack(ReturnPathIn &rp)
{
    return wait(rp, [this] { return acked_; });
}

} // namespace qmigd
