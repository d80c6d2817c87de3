// IncomingAttempt's parking: the blocks made as the stream announces them,
// handed to the daemon's list on the loop, and the parked VM's record.
#include "daemon/dest/incoming_attempt.h"

#include <unistd.h>

#include <spdlog/spdlog.h>

#include "protocol/wire.h"

namespace qmigd {

Status IncomingAttempt::park_announce(const std::vector<RamBlockDesc> &descs)
{
    // Nothing is deleted in a directory that a VM was parked in since
    // migrate-incoming checked it (another process that took no lock).
    QMIGD_TRY(park_dir_unclaimed(params_.park_dir));
    std::vector<RAMBlock> made;
    for (size_t i = 0; i < descs.size(); i++) {
        RamBlockSpec spec;
        spec.name = descs[i].idstr;
        spec.path = parked_block_path(params_.park_dir, i, descs[i].idstr);
        spec.size = descs[i].used_length;
        spec.open = ImageOpen::Create;
        // No vm.json here (park_dir_check): a file of that name is what a
        // park that was killed left, never part of a parked VM.
        if (::unlink(spec.path.c_str()) == 0) {
            spdlog::info("incoming migration: removed {}, left by an unfinished park",
                         spec.path);
        }
        auto b = ram_block_open(spec, false);
        QMIGD_TRY(b);
        {
            MutexLock lk(park_mu_);
            park_created_.push_back(spec.path);
        }
        b->image->scan_holes();
        made.push_back(std::move(*b));
    }
    QMIGD_TRY(hand_over_blocks(std::move(made)));
    spdlog::info("incoming migration: parking {} RAM blocks in {}", descs.size(),
                 params_.park_dir);
    if (params_.postcopy_ram) {
        for (const auto &b : blocks_) {
            received_.push_back(std::make_unique<ReceivedBitmap>(b.image->pages()));
        }
    }
    {
        MutexLock lk(park_mu_);
        park_descs_ = descs;
        park_ready_ = true;
    }
    park_cv_.notify_all();
    return {};
}

// blocks_ is the daemon's list, which the loop reads (a /metrics scrape
// lists its blocks): the loop appends the new ones, and the load thread
// reads the list once it has (blocks_handed_ under park_mu_ orders the two).
Status IncomingAttempt::hand_over_blocks(std::vector<RAMBlock> made)
{
    owner_.post_blocks(shared_from_this(), std::move(made));
    MutexLock lk(park_mu_);
    while (!blocks_handed_ && !park_abort_) {
        lk.wait(park_cv_);
    }
    if (!blocks_handed_) {
        return Error("aborted while the parked blocks were handed to the loop");
    }
    return {};
}

bool IncomingAttempt::request_cancel()
{
    MutexLock lk(park_mu_);
    if (park_committing_) {
        return false;
    }
    park_cancelled_ = true;
    cancel_requested_ = true;
    return true;
}

void IncomingAttempt::blocks_arrived()
{
    {
        MutexLock lk(park_mu_);
        blocks_handed_ = true;
    }
    park_cv_.notify_all();
}

const std::vector<RamBlockDesc> *IncomingAttempt::packet_blocks()
{
    if (!load_cfg_.park) {
        return &load_cfg_.blocks;
    }
    MutexLock lk(park_mu_);
    while (!park_ready_ && !park_abort_) {
        lk.wait(park_cv_);
    }
    return park_abort_ ? nullptr : &park_descs_;
}

Result<ParkedVm> IncomingAttempt::park_finish(LoadvmResult &result)
{
    ParkedVm vm;
    vm.dir = params_.park_dir;
    vm.machine_type = result.machine_type;
    vm.uuid = result.uuid;
    vm.ram_section_id = result.ram_section_id;
    {
        MutexLock lk(park_mu_);
        for (const auto &d : park_descs_) {
            vm.blocks.push_back({d.idstr, d.used_length});
        }
    }
    vm.device_state = std::move(result.device_state);
    vm.iterable_state = std::move(result.iterable_state);
    // Durable before the record names them: the record is the commit.
    for (const auto &b : blocks_) {
        QMIGD_TRY(b.image->sync());
    }
    {
        MutexLock lk(park_mu_);
        if (park_cancelled_) {
            return Error("migration cancelled");
        }
        park_committing_ = true;
    }
    QMIGD_TRY(parked_vm_write(vm));
    {
        MutexLock lk(park_mu_);
        park_committed_ = true;
    }
    spdlog::info("incoming migration: parked VM '{}' in {}: {} RAM blocks, {} bytes of device "
                 "state",
                 wire_text(vm.machine_type), vm.dir, vm.blocks.size(), vm.device_state.size());
    vm.device_state_bytes = vm.device_state.size();
    vm.device_state.clear(); // written; the loop keeps only the summary
    return vm;
}

} // namespace qmigd
