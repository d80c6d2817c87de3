// The destination's return path: the messages it sends the source (return_path.h).
#include "daemon/dest/return_path.h"

#include <spdlog/spdlog.h>

#include "daemon/channel.h"
#include "daemon/socket_io.h"
#include "protocol/postcopy.h"
#include "protocol/return_path.h"

namespace qmigd {

Result<std::unique_ptr<ReturnPathOut>> ReturnPathOut::open(Channel &ch, PeerWriteGuard &guard)
{
    QMIGD_TRY(return_path_check(ch.fd()));
    return std::unique_ptr<ReturnPathOut>(new ReturnPathOut(ch, guard));
}

Status ReturnPathOut::send(const std::vector<uint8_t> &msg)
{
    QMIGD_TRY(guard_.begin(ch_.fd(), msg.size()));
    Status st = ch_.write(msg.data(), msg.size());
    guard_.end();
    return st;
}

Status ReturnPathOut::pong(uint32_t value)
{
    std::vector<uint8_t> msg;
    rp_put_pong(msg, value);
    return send(msg);
}

Status ReturnPathOut::recv_bitmap(const std::string &idstr, const std::vector<uint64_t> &bits,
                                  uint64_t pages)
{
    std::vector<uint8_t> msg;
    rp_put_recv_bitmap(msg, idstr);
    rp_put_recv_bitmap_data(msg, bits, pages);
    return send(msg);
}

Status ReturnPathOut::resume_ack()
{
    std::vector<uint8_t> msg;
    rp_put_resume_ack(msg, MIGRATION_RESUME_ACK_VALUE);
    return send(msg);
}

Status ReturnPathOut::switchover_ack()
{
    std::vector<uint8_t> msg;
    rp_put_switchover_ack(msg);
    return send(msg);
}

void ReturnPathOut::shut(bool failed)
{
    std::vector<uint8_t> msg;
    rp_put_shut(msg, failed ? 1 : 0);
    if (Status st = send(msg); !st) {
        spdlog::info("return path: SHUT not delivered: {}", st.error().message());
    }
}

} // namespace qmigd
