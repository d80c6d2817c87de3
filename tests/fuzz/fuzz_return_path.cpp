// libFuzzer target: what a destination sends back on the return path, as
// a qmigd source reads it (header, then a payload of the length the header
// allows). A message that decodes has a known type, and names of no more
// bytes than the message carried; a page request that the queue takes
// lies inside its block; a recovery's received bitmap (read from the bytes
// after its message) has no bit past its block's end.
#include <cstdint>
#include <cstring>

#include "daemon/source/page_requests.h"
#include "daemon/source/postcopy_recovery.h"
#include "protocol/return_path.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const std::vector<RamBlockDesc> blocks = {{"mem", 1 << 20}, {"vga", 3 * TARGET_PAGE_SIZE}};
    PageRequests requests(blocks);
    PostcopyRecovery recovery(blocks);
    recovery.begin();
    while (size >= RP_HEADER_SIZE) {
        uint16_t type = 0, len = 0;
        if (!rp_header_decode(data, &type, &len).ok()) {
            return 0;
        }
        if (len > RP_MAX_PAYLOAD || type == MIG_RP_MSG_INVALID || type >= MIG_RP_MSG_MAX) {
            __builtin_trap();
        }
        data += RP_HEADER_SIZE;
        size -= RP_HEADER_SIZE;
        if (len > size) {
            return 0; // the reader would wait for the rest
        }
        uint8_t payload[RP_MAX_PAYLOAD]; // as the reader's buffer: exactly len bytes valid
        std::memcpy(payload, data, len);
        auto m = rp_payload_decode(type, payload, len);
        // A name decoded from the message lies inside it.
        size_t name_at = type == MIG_RP_MSG_REQ_PAGES_ID ? 13 : 1;
        if (m.ok() && !m->idstr.empty() && name_at + m->idstr.size() > len) {
            __builtin_trap();
        }
        if (m.ok() && (type == MIG_RP_MSG_REQ_PAGES || type == MIG_RP_MSG_REQ_PAGES_ID)) {
            (void)requests.push(type == MIG_RP_MSG_REQ_PAGES_ID ? &m->idstr : nullptr, m->start,
                                m->len);
            while (auto r = requests.pop()) {
                const RamBlockDesc &b = blocks.at(r->block);
                if (r->offset % TARGET_PAGE_SIZE || r->len == 0 || r->offset >= b.used_length ||
                    r->len > b.used_length - r->offset) {
                    __builtin_trap(); // the queue took a request outside its block
                }
            }
        }
        data += len;
        size -= len;
        if (m.ok() && type == MIG_RP_MSG_RECV_BITMAP) {
            auto read = [&](uint8_t *p, size_t n) -> Status {
                if (n > size) {
                    return Error("the return path ended");
                }
                std::memcpy(p, data, n);
                data += n;
                size -= n;
                return {};
            };
            if (!recovery.recv_bitmap(m->idstr, read).ok()) {
                return 0;
            }
            for (size_t i = 0; i < blocks.size(); i++) {
                uint64_t pages = blocks[i].used_length / TARGET_PAGE_SIZE;
                const auto &bits = recovery.received(i);
                if (!bits.empty() && (bits.size() != (pages + 63) / 64 ||
                                      (pages % 64 && bits.back() >> (pages % 64)))) {
                    __builtin_trap();
                }
            }
        }
        if (m.ok() && type == MIG_RP_MSG_RESUME_ACK) {
            (void)recovery.resume_ack(m->value);
            recovery.begin();
        }
    }
    return 0;
}
