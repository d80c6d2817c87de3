// Thread ownership the compiler checks: clang's thread-safety annotations, and the Mutex they name.
//
// A member shared between threads says which mutex guards it
// (GUARDED_BY(mu_)); a function that must be called with a mutex held says
// so (REQUIRES(mu_)); clang with -Wthread-safety (the clang build in CI,
// as an error) then checks every access, where a comment could only ask.
// GCC ignores the annotations. std::mutex carries none in libstdc++, hence
// Mutex and MutexLock.
//
// Condition variables: wait in a loop written out in the function that
// holds the lock (`while (!ready_) lock.wait(cv_);`), not with a predicate
// lambda: clang checks a lambda's body as a function of its own, which
// holds no lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define QMIGD_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define QMIGD_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) QMIGD_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY QMIGD_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) QMIGD_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) QMIGD_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) QMIGD_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) QMIGD_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) QMIGD_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) QMIGD_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) QMIGD_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define RETURN_CAPABILITY(x) QMIGD_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS QMIGD_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace qmigd {

// A std::mutex the analysis knows.
class CAPABILITY("mutex") Mutex {
public:
    void lock() ACQUIRE() { mu_.lock(); }
    void unlock() RELEASE() { mu_.unlock(); }
    bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

private:
    friend class MutexLock;
    std::mutex mu_;
};

// Holds a Mutex for its scope (std::unique_lock's part that qmigd uses);
// unlock()/lock() for a stretch without it; wait() on a condition variable
// releases it while waiting and holds it again on return.
class SCOPED_CAPABILITY MutexLock {
public:
    explicit MutexLock(Mutex &mu) ACQUIRE(mu) : lk_(mu.mu_) {}
    ~MutexLock() RELEASE() {}
    MutexLock(const MutexLock &) = delete;
    MutexLock &operator=(const MutexLock &) = delete;

    void unlock() RELEASE() { lk_.unlock(); }
    void lock() ACQUIRE() { lk_.lock(); }

    void wait(std::condition_variable &cv) { cv.wait(lk_); }
    // False once `limit` has passed.
    template <class Rep, class Period>
    bool wait_for(std::condition_variable &cv, std::chrono::duration<Rep, Period> limit)
    {
        return cv.wait_for(lk_, limit) == std::cv_status::no_timeout;
    }
    template <class Clock, class Duration>
    bool wait_until(std::condition_variable &cv, std::chrono::time_point<Clock, Duration> when)
    {
        return cv.wait_until(lk_, when) == std::cv_status::no_timeout;
    }

private:
    std::unique_lock<std::mutex> lk_;
};

} // namespace qmigd
