// MSG_ZEROCOPY sends and their completions from the socket's error queue.
#include "daemon/io/zero_copy.h"

#include <cerrno>
#include <cstring>
#include <linux/errqueue.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <fmt/format.h>

#include "daemon/socket_io.h"

namespace qmigd {

Status ZeroCopySender::enable(const UniqueFd &fd)
{
    int one = 1;
    if (::setsockopt(fd.get(), SOL_SOCKET, SO_ZEROCOPY, &one, sizeof(one)) != 0) {
        return Error("Zero copy send feature not detected in host kernel");
    }
    return {};
}

Status ZeroCopySender::writev(struct iovec *iov, int count)
{
    while (count > 0) {
        struct msghdr msg = {};
        msg.msg_iov = iov;
        msg.msg_iovlen = size_t(std::min(count, IOV_MAX));
        ssize_t r = ::sendmsg(fd_, &msg, MSG_ZEROCOPY);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0 && errno == ENOBUFS) {
            // Too much pinned for the socket's option memory: wait for the
            // kernel to let go of some (QEMU flushes here too).
            QMIGD_TRY(reap(true));
            continue;
        }
        if (r < 0) {
            return Error(fmt::format("write to migration channel (zero copy): {}",
                                     std::strerror(errno)));
        }
        queued_++;
        iov = iov_advance(iov, &count, size_t(r));
    }
    return {};
}

// Each completion covers the sendmsg() calls numbered ee_info..ee_data.
Status ZeroCopySender::reap(bool wait)
{
    for (;;) {
        char control[CMSG_SPACE(sizeof(struct sock_extended_err)) + 64];
        struct msghdr msg = {};
        msg.msg_control = control;
        msg.msg_controllen = sizeof(control);
        ssize_t r = ::recvmsg(fd_, &msg, MSG_ERRQUEUE | MSG_DONTWAIT);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0 && errno == EAGAIN) {
            if (!wait) {
                return {};
            }
            struct pollfd p = {fd_, POLLERR, 0};
            if (::poll(&p, 1, -1) < 0 && errno != EINTR) {
                return Error(fmt::format("zero copy: poll: {}", std::strerror(errno)));
            }
            if (p.revents & (POLLHUP | POLLNVAL)) {
                return Error("zero copy: the channel closed with sends pending");
            }
            continue;
        }
        if (r < 0) {
            return Error(fmt::format("zero copy: reading completions: {}", std::strerror(errno)));
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            bool recverr = (c->cmsg_level == SOL_IP && c->cmsg_type == IP_RECVERR) ||
                           (c->cmsg_level == SOL_IPV6 && c->cmsg_type == IPV6_RECVERR);
            if (!recverr) {
                continue;
            }
            struct sock_extended_err e;
            std::memcpy(&e, CMSG_DATA(c), sizeof(e));
            if (e.ee_origin != SO_EE_ORIGIN_ZEROCOPY || e.ee_errno != 0) {
                return Error(fmt::format("zero copy: a send failed: {}", std::strerror(e.ee_errno)));
            }
            done_ += uint64_t(e.ee_data - e.ee_info) + 1;
            reaped_ = true;
            zero_copied_ |= e.ee_code != SO_EE_CODE_ZEROCOPY_COPIED;
        }
        wait = false; // one completion is what a full queue waits for
    }
}

Status ZeroCopySender::flush(bool *all_copied)
{
    while (done_ < queued_) {
        QMIGD_TRY(reap(true));
    }
    *all_copied = reaped_ && !zero_copied_;
    reaped_ = zero_copied_ = false;
    return {};
}

} // namespace qmigd
