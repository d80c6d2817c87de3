// Channel: a migration channel's data calls, through its TLS session if it has one.
#include "daemon/channel.h"

#include "daemon/socket_io.h"
#include "daemon/tls/tls_session.h"

namespace qmigd {

Channel::Channel(UniqueFd fd) : fd_(std::move(fd)) {}

Channel::Channel(UniqueFd fd, std::unique_ptr<TlsSession> tls)
    : fd_(std::move(fd)), tls_(std::move(tls))
{
}

// The session goes first: it refers to the descriptor.
Channel::~Channel() { tls_.reset(); }

void Channel::set_tls(std::unique_ptr<TlsSession> tls) { tls_ = std::move(tls); }

Result<size_t> Channel::read_some(void *dst, size_t n)
{
    return channel_read(fd_.get(), tls_.get(), dst, n);
}

Status Channel::read_full(void *dst, size_t n)
{
    struct iovec iov = {dst, n};
    return readv(&iov, 1);
}

Status Channel::readv(struct iovec *iov, int count)
{
    return channel_readv(fd_.get(), tls_.get(), iov, count);
}

Status Channel::write(const void *buf, size_t n)
{
    return channel_write(fd_.get(), tls_.get(), buf, n);
}

Status Channel::writev(struct iovec *iov, int count)
{
    return channel_writev(fd_.get(), tls_.get(), iov, count);
}

void Channel::shutdown() { shutdown_fd(fd_.get()); }

} // namespace qmigd
