// Names the calling thread as QEMU 10 names its migration threads
// ("mig/src/main", "mig/src/send_0", "mig/dst/recv_0", ...), so top, perf
// and gdb show which thread is which, the same names for qmigd and QEMU.
#pragma once

#include <pthread.h>
#include <string>

namespace qmigd {

inline void set_thread_name(const std::string &name)
{
    // Linux keeps 15 characters; longer names are refused, so cut them.
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

} // namespace qmigd
