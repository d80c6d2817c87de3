// ReturnPathIn: the source's return-path reader thread and what it hands on.
#include "daemon/source/return_path.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/channel.h"
#include "daemon/source/page_requests.h"
#include "daemon/source/postcopy_recovery.h"
#include "daemon/thread_name.h"
#include "protocol/postcopy.h"
#include "protocol/return_path.h"

namespace qmigd {

ReturnPathIn::ReturnPathIn(Channel &ch, PageRequests *requests, PostcopyRecovery *recovery)
    : ch_(ch), requests_(requests), recovery_(recovery)
{
    thread_ = std::thread([this] {
        set_thread_name("mig/src/rp");
        run();
    });
}

ReturnPathIn::~ReturnPathIn()
{
    if (thread_.joinable()) {
        ch_.shutdown();
        thread_.join();
    }
}

std::optional<Error> ReturnPathIn::failed()
{
    MutexLock lk(mu_);
    return error_;
}

std::optional<Error> ReturnPathIn::failed_within(std::chrono::milliseconds limit)
{
    auto until = std::chrono::steady_clock::now() + limit;
    MutexLock lk(mu_);
    while (!ended_ && lk.wait_until(ended_cv_, until)) {
    }
    return error_;
}

bool ReturnPathIn::destination_misbehaved()
{
    MutexLock lk(mu_);
    return misbehaved_;
}

Status ReturnPathIn::wait()
{
    if (thread_.joinable()) {
        thread_.join();
    }
    auto err = failed();
    return err ? Status(*err) : Status();
}

// Exactly n bytes of the return path; EOF is an error.
static Status read_exact(Channel &ch, uint8_t *p, size_t n)
{
    while (n) {
        auto r = ch.read_some(p, n);
        QMIGD_TRY(r);
        if (*r == 0) {
            return Error("return path: the destination closed it without a SHUT");
        }
        p += *r;
        n -= *r;
    }
    return {};
}

Status ReturnPathIn::read(uint8_t *p, size_t n)
{
    Status st = read_exact(ch_, p, n);
    if (!st) {
        link_failed_ = true;
    }
    return st;
}

Status ReturnPathIn::read_message(bool *shut)
{
    uint8_t header[RP_HEADER_SIZE];
    QMIGD_TRY(read(header, sizeof(header)));
    uint16_t type = 0, len = 0;
    QMIGD_TRY(rp_header_decode(header, &type, &len));
    uint8_t payload[RP_MAX_PAYLOAD];
    if (Status st = read(payload, len); !st) {
        return Error(fmt::format("Failed reading data for message 0x{:04x}: {}", type,
                                 st.error().message()));
    }
    auto m = rp_payload_decode(type, payload, len);
    QMIGD_TRY(m);
    switch (m->type) {
    case MIG_RP_MSG_SHUT:
        *shut = true;
        spdlog::info("return path: the destination says {}",
                     m->value ? "it failed" : "it is done");
        if (m->value) {
            return Error(fmt::format("Sibling indicated error {}", m->value));
        }
        return {};
    case MIG_RP_MSG_PONG:
        spdlog::debug("return path: PONG {}", m->value);
        return {};
    case MIG_RP_MSG_REQ_PAGES:
    case MIG_RP_MSG_REQ_PAGES_ID:
        if (!requests_) {
            break;
        }
        return requests_->push(m->type == MIG_RP_MSG_REQ_PAGES_ID ? &m->idstr : nullptr,
                               m->start, m->len);
    case MIG_RP_MSG_RECV_BITMAP:
        if (!recovery_) {
            break;
        }
        return recovery_->recv_bitmap(
            m->idstr, [this](uint8_t *p, size_t n) { return read(p, n); });
    case MIG_RP_MSG_RESUME_ACK:
        // QEMU 10 takes it in any migration with a return path and drops it
        // outside a recovery: so does a source without postcopy.
        return recovery_ ? recovery_->resume_ack(m->value)
                         : PostcopyRecovery::check_resume_ack(m->value);
    case MIG_RP_MSG_SWITCHOVER_ACK:
        // Taken whether or not switchover-ack is on, as QEMU does.
        spdlog::info("return path: the destination acknowledges the switchover");
        {
            MutexLock lk(mu_);
            switchover_acked_ = true;
        }
        ended_cv_.notify_all();
        return {};
    default:
        break;
    }
    // Bitmaps and acks belong to postcopy recovery.
    return Error(fmt::format("return path: '{}' message (0x{:04x}) but postcopy is not "
                             "running",
                             rp_message_name(m->type), m->type));
}

void ReturnPathIn::wait_switchover_ack(std::chrono::milliseconds limit)
{
    auto until = std::chrono::steady_clock::now() + limit;
    MutexLock lk(mu_);
    while (!switchover_acked_.load() && !ended_ && lk.wait_until(ended_cv_, until)) {
    }
}

void ReturnPathIn::run()
{
    bool shut = false;
    Status st;
    while (st && !shut) {
        st = read_message(&shut);
    }
    {
        MutexLock lk(mu_);
        if (!st) {
            error_ = st.error();
            misbehaved_ = !link_failed_;
        }
        ended_ = true;
    }
    ended_cv_.notify_all();
    if (recovery_) {
        recovery_->return_path_ended();
    }
}

} // namespace qmigd
