// The guest control record: a small shared file through which the
// migration source pauses, resumes and throttles whoever writes guest RAM
// (format: ramstate/README.md).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "protocol/error.h"
#include "ramstate/shared_file.h"

namespace qmigd {

// The record as it lies in the file. Every field is accessed atomically;
// each is written by one side only (noted per field).
struct GuestControlRecord {
    uint32_t magic;         // kGuestControlMagic
    uint32_t version;       // 1
    uint32_t pause_req;     // source: 1 = pause, 0 = run
    uint32_t paused_ack;    // guest: 1 = paused, no write in flight
    uint32_t throttle_pct;  // source: 0..99, share of time the guest sleeps
    uint32_t guest_pid;     // guest: its pid while attached, else 0
    uint64_t heartbeat;     // guest: incremented by its loop
    uint64_t pages_written; // guest: pages written so far
    uint8_t reserved[24];
};
static_assert(sizeof(GuestControlRecord) == 64);

constexpr uint32_t kGuestControlMagic = 0x43474d51; // "QMGC" little-endian

class GuestControl {
public:
    static Result<std::unique_ptr<GuestControl>> open(const std::string &path,
                                                      SideFileName name = SideFileName::Named);
    ~GuestControl();

    // --- source side ---
    // Asks the guest to pause and waits for its acknowledgement (the page
    // in flight is written and marked). Returns at once when no live guest
    // is attached; fails after `timeout` if an attached guest never answers.
    // `abort`, where given, ends the wait early with an error (a cancel).
    Status pause(std::chrono::milliseconds timeout, const std::atomic<bool> *abort = nullptr);
    void resume();
    void set_throttle(unsigned pct);
    unsigned throttle() const;
    bool guest_attached() const;
    uint64_t pages_written() const;

    // --- guest side ---
    void attach();
    void detach();
    // Called between page writes: acknowledges and waits out a pause (or
    // until `stop` is set). Returns false if it had to wait (the caller may
    // reset its pacing).
    bool check_pause(const std::atomic<bool> &stop);
    void count_write();

    const std::string &path() const { return file_->path(); }

private:
    GuestControl() = default;
    template <typename T>
    std::atomic_ref<T> field(T &f) const
    {
        return std::atomic_ref<T>(f);
    }

    std::unique_ptr<SharedFile> file_;
    GuestControlRecord *rec_ = nullptr; // in file_, shared with another process
};

} // namespace qmigd
