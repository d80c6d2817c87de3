// The destination's side of the return path (QEMU's migrate_send_rp_*()):
// messages back to the source over the main channel's socket, read the
// other way, framed in protocol/return_path.h.
//
// Precopy sends its verdict: SHUT(0) once the whole stream loaded (a parked
// VM is durable by then), SHUT(1) when loading failed, so that the source
// fails too instead of reporting `completed` for a VM nobody runs; and
// PONG, the answer to each PING command. Postcopy adds page requests
// (sent by the image handler) and a recovery's bitmaps and RESUME_ACK.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "protocol/error.h"

namespace qmigd {

class PeerWriteGuard;
class Channel;

// Destination: what goes back. Used by the load thread only; every write
// goes through `guard`, which the migration's abort ends (a source that
// never reads its return path must not hold the load thread in send()).
class ReturnPathOut {
public:
    // `ch` must be a socket (the return path is its other direction);
    // borrowed: its owner keeps it until this object goes.
    static Result<std::unique_ptr<ReturnPathOut>> open(Channel &ch, PeerWriteGuard &guard);
    Status pong(uint32_t value);
    // Postcopy recovery: a block's received bitmap, and RESUME_ACK.
    Status recv_bitmap(const std::string &idstr, const std::vector<uint64_t> &bits,
                       uint64_t pages);
    Status resume_ack();
    // switchover-ack: the source may switch over (no device holds it).
    Status switchover_ack();
    // The verdict; a source that is gone already is not an error here.
    void shut(bool failed);

private:
    ReturnPathOut(Channel &ch, PeerWriteGuard &guard) : ch_(ch), guard_(guard) {}
    Status send(const std::vector<uint8_t> &msg);

    Channel &ch_;
    PeerWriteGuard &guard_;
};

} // namespace qmigd
