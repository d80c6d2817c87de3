// The return path: messages a destination sends back to its source on the
// main channel's socket (QEMU's migration.c, enum mig_rp_message_type and
// source_return_path_thread()). Each is be16 type, be16 length, payload.
// qmigd speaks the precopy part: SHUT (the destination's verdict) and PONG
// (the answer to a PING command); the postcopy messages are decoded and
// checked, and a source without postcopy refuses them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "protocol/error.h"
#include "protocol/wire.h"

namespace qmigd {

enum MigRpMessageType : uint16_t {
    MIG_RP_MSG_INVALID = 0,
    MIG_RP_MSG_SHUT = 1,           // be32: 0 done, else the destination failed
    MIG_RP_MSG_PONG = 2,           // be32: the PING's value
    MIG_RP_MSG_REQ_PAGES_ID = 3,   // be64 start, be32 len, u8 idlen, idstr
    MIG_RP_MSG_REQ_PAGES = 4,      // be64 start, be32 len
    MIG_RP_MSG_RECV_BITMAP = 5,    // u8 idlen, idstr
    MIG_RP_MSG_RESUME_ACK = 6,     // be32
    MIG_RP_MSG_SWITCHOVER_ACK = 7, // no payload
    MIG_RP_MSG_MAX = 8,
};

constexpr size_t RP_HEADER_SIZE = 4;
// The largest payload a source reads (QEMU's buffer).
constexpr size_t RP_MAX_PAYLOAD = 512;

// A PING's value that qmigd and QEMU send right after OPEN_RETURN_PATH.
constexpr uint32_t RP_PING_OPEN = 1;

struct RpMessage {
    uint16_t type = MIG_RP_MSG_INVALID;
    uint32_t value = 0;  // SHUT, PONG, RESUME_ACK
    uint64_t start = 0;  // REQ_PAGES(_ID)
    uint32_t len = 0;    // REQ_PAGES(_ID)
    std::string idstr;   // REQ_PAGES_ID, RECV_BITMAP
};

// Checks a header (type and payload length) as QEMU's source does; on
// success *len is the payload's length. Errors in QEMU's words.
Status rp_header_decode(const uint8_t header[RP_HEADER_SIZE], uint16_t *type, uint16_t *len);
// The payload of a message whose header passed rp_header_decode().
Result<RpMessage> rp_payload_decode(uint16_t type, const uint8_t *payload, uint16_t len);
// A message's name ("SHUT", ...), for logs and errors.
const char *rp_message_name(uint16_t type);

// Destination side.
void rp_put_shut(std::vector<uint8_t> &out, uint32_t failed);
void rp_put_pong(std::vector<uint8_t> &out, uint32_t value);
void rp_put_resume_ack(std::vector<uint8_t> &out, uint32_t value);
void rp_put_switchover_ack(std::vector<uint8_t> &out);
// The message only; the bitmap follows it (protocol/postcopy.h).
void rp_put_recv_bitmap(std::vector<uint8_t> &out, std::string_view idstr);

} // namespace qmigd
