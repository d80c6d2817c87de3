// Decoder of QEMU 10's main migration channel: the destination's
// qemu_loadvm_state() + ram_load_precopy().
//
// It validates every field against the destination's configuration before
// acting on it; pages are handed to a LoadvmHandler only with an offset
// that lies inside the named RAMBlock.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "protocol/error.h"
#include "protocol/mapped_ram.h"
#include "protocol/qemu_file.h"
#include "protocol/qemu_format.h"

namespace qmigd {

struct LoadvmConfig {
    std::string machine_type = "none";
    std::vector<RamBlockDesc> blocks;
    bool multifd = false;
    // The mapped-ram capability: the source must have it on too, and each
    // block's pages are in the file, not the stream.
    bool mapped_ram = false;
    // x-ignore-shared: the source must have it on too; the RAM list gives
    // each block's address, checked against ours (RamBlockDesc::addr), and
    // no page of a shared block need come (both ends map the same file).
    bool ignore_shared = false;
    // Our own UUID; checked against configuration/uuid when both are set.
    Uuid uuid{};
    // Parking a VM: any machine type and any RAM layout are taken (the
    // blocks come from the stream, LoadvmHandler::announce_blocks), and
    // everything from the first device section on is kept as it came
    // (LoadvmResult::device_state).
    bool park = false;
    // postcopy-ram: the source may switch to postcopy (POSTCOPY_ADVISE,
    // RAM_DISCARD, and the device state in a PACKAGED command between
    // LISTEN and RUN, before the rest of RAM).
    bool postcopy_ram = false;
};

// What the loader asks of the owner of guest RAM. Called on the loader's
// thread only.
class LoadvmHandler {
public:
    virtual ~LoadvmHandler() = default;
    // A page's 4096 bytes arrived for (block, offset).
    virtual Status put_page(size_t block, uint64_t offset, const uint8_t *data) = 0;
    // The page's current bytes (an XBZRLE record is a delta against them).
    virtual Status read_page(size_t block, uint64_t offset, uint8_t *out)
    {
        (void)block;
        (void)offset;
        (void)out;
        return Error("this destination cannot read pages back");
    }
    // The page must read as zeros afterwards.
    virtual Status zero_page(size_t block, uint64_t offset) = 0;
    // MULTIFD_FLUSH: wait until every multifd channel has delivered all
    // pages sent before this point (one more SYNC each).
    virtual Status multifd_flush() = 0;
    // mapped-ram: a block's header was read; load its pages from the file.
    // The stream then goes on after the block's pages region.
    virtual Status mapped_ram_block(size_t block, const MappedRamHeader &h)
    {
        (void)block;
        (void)h;
        return Error("mapped-ram is not enabled");
    }
    // Park mode: the ram START section's block list, once, before any page
    // of it. Block indexes in the calls above are positions in it.
    virtual Status announce_blocks(const std::vector<RamBlockDesc> &blocks)
    {
        (void)blocks;
        return Error("this destination does not park VMs");
    }
    // MIG_CMD_OPEN_RETURN_PATH: from now on the source reads our messages
    // (protocol/return_path.h) on the main channel's socket.
    virtual Status open_return_path() { return Error("this destination has no return path"); }
    // MIG_CMD_PING, after OPEN_RETURN_PATH: answer with a PONG of `value`.
    virtual Status ping(uint32_t value)
    {
        (void)value;
        return Error("this destination has no return path");
    }
    // Progress notice: the main channel is about to read (for status).
    virtual void loading_started() {}
    // POSTCOPY_LISTEN: the source has switched over; the device state is
    // in and the rest of RAM follows (for status).
    virtual void postcopy_listening() {}
    // Postcopy recovery: RECV_BITMAP for a block (checked): send the
    // received bitmap back on the return path.
    virtual Status send_recv_bitmap(size_t block)
    {
        (void)block;
        return Error("this destination cannot recover a postcopy migration");
    }
    // POSTCOPY_RESUME during a recovery: acknowledge, and go on.
    virtual Status postcopy_resume() { return Error("no postcopy recovery in progress"); }
    // POSTCOPY_RAM_DISCARD of a range inside a block (checked): pages the
    // source will send again. A destination without a running guest has
    // nothing to drop: the new copy overwrites the stale one.
    virtual Status discard_range(size_t block, uint64_t start, uint64_t length)
    {
        (void)block;
        (void)start;
        (void)length;
        return {};
    }
};

struct LoadvmResult {
    std::string runstate = "running"; // from globalstate, if sent
    uint64_t normal_pages = 0;        // PAGE records
    uint64_t zero_pages = 0;          // ZERO records
    uint64_t xbzrle_pages = 0;        // XBZRLE records
    uint64_t flushes = 0;             // MULTIFD_FLUSH records
    // Park mode: what a resumed VM's stream must carry again.
    std::string machine_type;
    std::optional<Uuid> uuid;    // configuration/uuid, if sent
    uint32_t ram_section_id = 0; // the ram section's id in the source's numbering
    std::vector<uint8_t> device_state; // first FULL section .. VM description
    // Iterable sections other than RAM's (dirty-bitmap), whole, in stream
    // order, each behind a be32 length (protocol/iterable_state.h).
    std::vector<uint8_t> iterable_state;
    bool postcopy = false; // the source switched to postcopy (RUN was read)
};

// Reads header .. EOF (and the VM description, when present).
Result<LoadvmResult> qemu_loadvm_state(QEMUFileReader &f, const LoadvmConfig &cfg,
                                       LoadvmHandler &handler);

class Loader;

// The same, for a load that may pause: once postcopy runs, a broken main
// channel leaves the loader where it stood (QEMU's postcopy_pause_incoming),
// and resume() goes on with the stream of a new channel, which has no
// header: RECV_BITMAP commands, POSTCOPY_RESUME, the rest of RAM.
class LoadvmSession {
public:
    LoadvmSession(const LoadvmConfig &cfg, LoadvmHandler &handler);
    ~LoadvmSession();
    Result<LoadvmResult> load(QEMUFileReader &f);
    Result<LoadvmResult> resume(QEMUFileReader &f);
    // RUN was read: the guest may run elsewhere, so a failure pauses.
    bool in_postcopy() const;

private:
    const LoadvmConfig cfg_; // the loader refers to it: a copy lives as long
    std::unique_ptr<Loader> loader_;
};

// Postcopy's preempt channel (QEMU's postcopy_preempt_thread()): ZERO and
// PAGE records of cfg.blocks with no section framing, up to the EOS that
// ends it (the source sends it as the migration completes); a channel
// closed before its first record is empty, one closed later without the
// EOS broke. Returns the pages loaded.
Result<LoadvmResult> qemu_load_preempt_channel(QEMUFileReader &f, const LoadvmConfig &cfg,
                                               LoadvmHandler &handler);

} // namespace qmigd
