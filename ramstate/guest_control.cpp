// The guest control record: mapping it, pausing and throttling the guest through it.
#include "ramstate/guest_control.h"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <thread>
#include <unistd.h>

#include <fmt/format.h>

namespace qmigd {

Result<std::unique_ptr<GuestControl>> GuestControl::open(const std::string &path, SideFileName name)
{
    auto file = SharedFile::open(path, sizeof(GuestControlRecord), "guest control", name);
    QMIGD_TRY(file);
    std::unique_ptr<GuestControl> gc(new GuestControl());
    gc->file_ = std::move(*file);
    gc->rec_ = static_cast<GuestControlRecord *>(gc->file_->data());
    uint32_t expected = 0;
    // First opener initialises the record (a fresh file is all zeros).
    if (std::atomic_ref<uint32_t>(gc->rec_->magic).compare_exchange_strong(expected,
                                                                           kGuestControlMagic)) {
        std::atomic_ref<uint32_t>(gc->rec_->version).store(1);
    } else if (expected != kGuestControlMagic) {
        return Error(fmt::format("'{}' is not a guest control record", path));
    }
    return gc;
}

GuestControl::~GuestControl() = default;

bool GuestControl::guest_attached() const
{
    uint32_t pid = field(rec_->guest_pid).load(std::memory_order_acquire);
    // A guest that died without detaching does not hold anybody up.
    return pid != 0 && (kill(pid_t(pid), 0) == 0 || errno == EPERM);
}

Status GuestControl::pause(std::chrono::milliseconds timeout, const std::atomic<bool> *abort)
{
    // Release: pairs with the acquire load in check_pause().
    field(rec_->pause_req).store(1, std::memory_order_release);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    // Acquire: pairs with the guest's release store of paused_ack, after
    // which every page it wrote (and its dirty bit) is visible here.
    while (field(rec_->paused_ack).load(std::memory_order_acquire) != 1) {
        if (!guest_attached()) {
            return {};
        }
        if (abort && abort->load()) {
            return Error("cancelled while waiting for the guest to pause");
        }
        if (std::chrono::steady_clock::now() > deadline) {
            return Error(fmt::format("guest (pid {}) did not acknowledge the pause within {} ms",
                                     field(rec_->guest_pid).load(), timeout.count()));
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return {};
}

void GuestControl::resume() { field(rec_->pause_req).store(0, std::memory_order_release); }

void GuestControl::set_throttle(unsigned pct)
{
    field(rec_->throttle_pct).store(pct > 99 ? 99 : pct, std::memory_order_relaxed);
}

unsigned GuestControl::throttle() const
{
    return field(rec_->throttle_pct).load(std::memory_order_relaxed);
}

uint64_t GuestControl::pages_written() const
{
    return field(rec_->pages_written).load(std::memory_order_relaxed);
}

void GuestControl::attach()
{
    field(rec_->paused_ack).store(0, std::memory_order_relaxed);
    field(rec_->guest_pid).store(uint32_t(getpid()), std::memory_order_release);
}

void GuestControl::detach()
{
    field(rec_->guest_pid).store(0, std::memory_order_release);
    field(rec_->paused_ack).store(0, std::memory_order_release);
}

bool GuestControl::check_pause(const std::atomic<bool> &stop)
{
    field(rec_->heartbeat).fetch_add(1, std::memory_order_relaxed);
    if (field(rec_->pause_req).load(std::memory_order_acquire) == 0) {
        return true;
    }
    field(rec_->paused_ack).store(1, std::memory_order_release);
    while (field(rec_->pause_req).load(std::memory_order_acquire) != 0 && !stop) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    field(rec_->paused_ack).store(0, std::memory_order_release);
    return false;
}

void GuestControl::count_write()
{
    field(rec_->pages_written).fetch_add(1, std::memory_order_relaxed);
}

} // namespace qmigd
