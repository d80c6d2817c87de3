// Blocking channel and file I/O for the migration threads, through TLS when the channel has it.
#include "daemon/socket_io.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/channel.h"
#include "daemon/tls/tls_session.h"

namespace qmigd {

namespace {

Error errno_error(const char *what) { return Error(std::string(what) + ": " + std::strerror(errno)); }

} // namespace

struct iovec *iov_advance(struct iovec *iov, int *count, size_t n)
{
    while (*count > 0 && n >= iov->iov_len) {
        n -= iov->iov_len;
        iov++;
        (*count)--;
    }
    if (*count > 0) {
        iov->iov_base = static_cast<uint8_t *>(iov->iov_base) + n;
        iov->iov_len -= n;
    }
    return iov;
}

ssize_t FdInputStream::read_some(void *dst, size_t n, std::string *err)
{
    if (prefix_pos_ < prefix_.size()) {
        size_t k = std::min(n, prefix_.size() - prefix_pos_);
        std::memcpy(dst, prefix_.data() + prefix_pos_, k);
        prefix_pos_ += k;
        return ssize_t(k);
    }
    auto r = ch_.read_some(dst, n);
    if (!r) {
        *err = "main channel: " + r.error().message();
        return -1;
    }
    return ssize_t(*r);
}

Result<size_t> channel_read(int fd, TlsSession *tls, void *dst, size_t n)
{
    if (tls) {
        return tls->read(dst, n);
    }
    for (;;) {
        ssize_t r = ::read(fd, dst, n);
        if (r >= 0) {
            return size_t(r);
        }
        if (errno != EINTR) {
            return errno_error("read from migration channel");
        }
    }
}

// Reads until the iovecs are full: `op` reads some bytes into them and
// returns how many (0: the end of the stream, an error here).
template <typename Op>
static Status read_all(struct iovec *iov, int count, Op op)
{
    while (count > 0) {
        auto r = op(iov, count);
        QMIGD_TRY(r);
        if (*r == 0) {
            return Error("unexpected end of stream in the middle of a packet");
        }
        iov = iov_advance(iov, &count, *r);
    }
    return {};
}

Status readv_full(int fd, struct iovec *iov, int count)
{
    return read_all(iov, count, [fd](struct iovec *v, int n) -> Result<size_t> {
        for (;;) {
            ssize_t r = ::readv(fd, v, std::min(n, IOV_MAX));
            if (r >= 0) {
                return size_t(r);
            }
            if (errno != EINTR) {
                return errno_error("read from migration channel");
            }
        }
    });
}

Status channel_readv(int fd, TlsSession *tls, struct iovec *iov, int count)
{
    if (!tls) {
        return readv_full(fd, iov, count);
    }
    return read_all(iov, count,
                    [tls](struct iovec *v, int) { return tls->read(v->iov_base, v->iov_len); });
}

void ChannelReader::drain(struct iovec *&iov, int &count)
{
    while (count > 0 && head_ < tail_) {
        size_t k = std::min(iov->iov_len, tail_ - head_);
        std::memcpy(iov->iov_base, buf_.get() + head_, k);
        head_ += k;
        iov = iov_advance(iov, &count, k);
    }
}

Result<int> ChannelReader::read(void *dst, size_t n)
{
    struct iovec one = {dst, n};
    struct iovec *iov = &one;
    int count = 1;
    bool got_any = head_ < tail_;
    drain(iov, count);
    while (count > 0) {
        if (iov->iov_len >= cap_ / 2) {
            QMIGD_TRY(readv(iov, count)); // large: no point in buffering
            return 1;
        }
        auto got = ch_.read_some(buf_.get(), cap_);
        QMIGD_TRY(got);
        size_t r = *got;
        if (r == 0) {
            if (!got_any && iov->iov_len == n) {
                return 0;
            }
            return Error("unexpected end of stream in the middle of a packet");
        }
        got_any = true;
        head_ = 0;
        tail_ = r;
        drain(iov, count);
    }
    return 1;
}

Status ChannelReader::readv(struct iovec *iov, int count)
{
    drain(iov, count);
    return ch_.readv(iov, count);
}

Status channel_writev(int fd, TlsSession *tls, struct iovec *iov, int count)
{
    return tls ? tls->writev(iov, count) : writev_full(fd, iov, count);
}

Status channel_write(int fd, TlsSession *tls, const void *buf, size_t n)
{
    return tls ? tls->write(buf, n) : write_full(fd, buf, n);
}

Status writev_full(int fd, struct iovec *iov, int count)
{
    while (count > 0) {
        ssize_t r = ::writev(fd, iov, std::min(count, IOV_MAX));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            return errno_error("write to migration channel");
        }
        iov = iov_advance(iov, &count, size_t(r));
    }
    return {};
}

Status write_full(int fd, const void *buf, size_t n)
{
    struct iovec iov = {const_cast<void *>(buf), n};
    return writev_full(fd, &iov, 1);
}

bool FdInputStream::seek(uint64_t pos, std::string *err)
{
    if (::lseek(ch_.fd(), off_t(pos), SEEK_SET) < 0) {
        *err = fmt::format("Unable to seek to offset {} whence {} in file: {}", pos, SEEK_SET,
                           std::strerror(errno));
        return false;
    }
    prefix_pos_ = prefix_.size();
    return true;
}

// pwritev/preadv until the iovecs are done: EINTR retried, short transfers
// continued; `what` names the direction in the error.
template <typename Op>
static Status positioned_io(int fd, struct iovec *iov, int count, uint64_t offset, Op op,
                            const char *what, const char *at_zero)
{
    while (count > 0) {
        ssize_t r = op(fd, iov, std::min(count, IOV_MAX), off_t(offset));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return Error(fmt::format("Unable to {} file at offset 0x{:x}: {}", what, offset,
                                     r < 0 ? std::strerror(errno) : at_zero));
        }
        offset += uint64_t(r);
        iov = iov_advance(iov, &count, size_t(r));
    }
    return {};
}

Status pwritev_full(int fd, struct iovec *iov, int count, uint64_t offset)
{
    return positioned_io(fd, iov, count, offset, ::pwritev, "write to", "no progress");
}

Status pwrite_full(int fd, const void *buf, size_t n, uint64_t offset)
{
    struct iovec iov = {const_cast<void *>(buf), n};
    return pwritev_full(fd, &iov, 1, offset);
}

Status preadv_full(int fd, struct iovec *iov, int count, uint64_t offset)
{
    return positioned_io(fd, iov, count, offset, ::preadv, "read from", "unexpected end of file");
}

Status pread_full(int fd, void *buf, size_t n, uint64_t offset)
{
    struct iovec iov = {buf, n};
    return preadv_full(fd, &iov, 1, offset);
}

} // namespace qmigd
