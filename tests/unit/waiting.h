// Waiting for an event in a unit test, never for a time (the integration
// tests' scripts/lib/waiting.py, in C++). The deadline only guards
// against a hang: the suite runs side by side, under sanitizers and
// beside a CPU hog.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

namespace qmigd::testing {

inline constexpr std::chrono::seconds kDeadline{60};

// Polls `done` until it holds; false if the deadline passed first.
inline bool wait_until(const std::function<bool()> &done,
                       std::chrono::milliseconds deadline = kDeadline)
{
    auto end = std::chrono::steady_clock::now() + deadline;
    while (!done()) {
        if (std::chrono::steady_clock::now() > end) {
            return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
}

inline pid_t this_tid() { return pid_t(::syscall(SYS_gettid)); }

// Whether thread `tid` of this process sleeps inside a system call: its
// state is S or D and /proc's syscall file names one (a running thread's
// says "running"). What "blocked in read()" means, seen from outside.
inline bool blocked_in_syscall(pid_t tid)
{
    std::string dir = "/proc/self/task/" + std::to_string(tid) + "/";
    std::ifstream stat(dir + "stat"), sys(dir + "syscall");
    std::string text((std::istreambuf_iterator<char>(stat)), {}), call;
    auto paren = text.rfind(')');
    if (paren == std::string::npos || paren + 2 >= text.size() || !(sys >> call)) {
        return false;
    }
    char state = text[paren + 2];
    return (state == 'S' || state == 'D') && call != "running";
}

// Waits until the thread whose id `tid` publishes (0 until it starts) is
// blocked in a system call.
template <typename AtomicTid> bool wait_blocked(const AtomicTid &tid)
{
    return wait_until([&] { return tid.load() != 0 && blocked_in_syscall(tid.load()); });
}

} // namespace qmigd::testing
