// Return-path messages: framing, each message's encoder, and the checked decoder.
#include "protocol/return_path.h"

#include <fmt/format.h>

#include "protocol/qemu_format.h"

namespace qmigd {

namespace {

constexpr MessageArgs kRpArgs[MIG_RP_MSG_MAX] = {
    {-1, "INVALID"},   {4, "SHUT"},        {4, "PONG"},       {-1, "REQ_PAGES_ID"},
    {12, "REQ_PAGES"}, {-1, "RECV_BITMAP"}, {4, "RESUME_ACK"}, {0, "SWITCHOVER_ACK"},
};

void put_message(std::vector<uint8_t> &out, uint16_t type, uint32_t value)
{
    ByteWriter w(out);
    w.be16(type);
    w.be16(4);
    w.be32(value);
}

} // namespace

const char *rp_message_name(uint16_t type)
{
    return type < MIG_RP_MSG_MAX ? kRpArgs[type].name : "unknown";
}

Status rp_header_decode(const uint8_t header[RP_HEADER_SIZE], uint16_t *type, uint16_t *len)
{
    *type = get_be16(header);
    *len = get_be16(header + 2);
    if (*type >= MIG_RP_MSG_MAX || *type == MIG_RP_MSG_INVALID) {
        return Error(fmt::format("Received invalid message 0x{:04x} length 0x{:04x}", *type,
                                 *len));
    }
    const MessageArgs &a = kRpArgs[*type];
    if ((a.len != -1 && *len != a.len) || *len > RP_MAX_PAYLOAD) {
        // QEMU's words, the missing space included.
        return Error(fmt::format("Received '{}' message (0x{:04x}) withincorrect length {} "
                                 "expecting {}",
                                 a.name, *type, *len, size_t(a.len)));
    }
    return {};
}

Result<RpMessage> rp_payload_decode(uint16_t type, const uint8_t *p, uint16_t len)
{
    RpMessage m;
    m.type = type;
    switch (type) {
    case MIG_RP_MSG_SHUT:
    case MIG_RP_MSG_PONG:
    case MIG_RP_MSG_RESUME_ACK:
        m.value = get_be32(p);
        return m;
    case MIG_RP_MSG_REQ_PAGES:
        m.start = get_be64(p);
        m.len = get_be32(p + 8);
        return m;
    case MIG_RP_MSG_REQ_PAGES_ID: {
        size_t expected = 13;
        if (len >= expected) {
            m.start = get_be64(p);
            m.len = get_be32(p + 8);
            expected += p[12];
        }
        if (len != expected) {
            return Error(fmt::format("Req_Page_id with length {} expecting {}", len, expected));
        }
        m.idstr.assign(reinterpret_cast<const char *>(p + 13), p[12]);
        return m;
    }
    case MIG_RP_MSG_RECV_BITMAP:
        if (len < 1) {
            return Error("MIG_RP_MSG_RECV_BITMAP missing block name");
        }
        if (size_t(p[0]) + 1 > len) {
            return Error("MIG_RP_MSG_RECV_BITMAP block name longer than the message");
        }
        m.idstr.assign(reinterpret_cast<const char *>(p + 1), p[0]);
        return m;
    default:
        return m; // SWITCHOVER_ACK
    }
}

void rp_put_shut(std::vector<uint8_t> &out, uint32_t failed)
{
    put_message(out, MIG_RP_MSG_SHUT, failed);
}

void rp_put_pong(std::vector<uint8_t> &out, uint32_t value)
{
    put_message(out, MIG_RP_MSG_PONG, value);
}

void rp_put_resume_ack(std::vector<uint8_t> &out, uint32_t value)
{
    put_message(out, MIG_RP_MSG_RESUME_ACK, value);
}

void rp_put_switchover_ack(std::vector<uint8_t> &out)
{
    ByteWriter w(out);
    w.be16(MIG_RP_MSG_SWITCHOVER_ACK);
    w.be16(0);
}

void rp_put_recv_bitmap(std::vector<uint8_t> &out, std::string_view idstr)
{
    ByteWriter w(out);
    w.be16(MIG_RP_MSG_RECV_BITMAP);
    w.be16(uint16_t(1 + idstr.size()));
    w.cstr8(idstr);
}

} // namespace qmigd
