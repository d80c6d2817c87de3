// Connecting migration channels: resolve off the loop, connect each channel, try the next address.
#include "daemon/io/socket_connect.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "daemon/io/migration_socket.h"
#include "daemon/io/stream_handle.h"

namespace qmigd {

struct SocketConnect::Attempt {
    uv_connect_t req;
    StreamHandle h;
    std::shared_ptr<SocketConnect> owner; // keeps it alive until closed
    size_t index = 0;
};

std::shared_ptr<SocketConnect> SocketConnect::start(uv_loop_t *loop, const SocketAddress &addr,
                                                    unsigned count, Connected done)
{
    std::shared_ptr<SocketConnect> c(new SocketConnect(loop, addr, count, std::move(done)));
    if (addr.type == SocketAddress::Type::Unix) {
        if (auto st = check_unix_path(addr.path); !st) {
            c->finish(st.error());
            return c;
        }
        c->addrs_.emplace_back(); // the path is the address
        c->try_address(0);
        return c;
    }
    // The lookup holds a reference until it answers or is cancelled.
    c->lookup_ = NameLookup::start(loop, addr.host, std::to_string(addr.port), 0,
                                   [c](int rc, const std::vector<sockaddr_storage> &addrs) {
                                       c->resolved(rc, addrs);
                                   });
    if (!c->lookup_) {
        c->finish(Error(fmt::format("address resolution failed for {}:{}: {}", addr.host,
                                    addr.port, NameLookup::too_many())));
    }
    return c;
}

void SocketConnect::resolved(int rc, const std::vector<sockaddr_storage> &addrs)
{
    std::unique_ptr<NameLookup> done = std::move(lookup_); // freed on return
    if (cancelled_) {
        return;
    }
    addrs_ = addrs;
    if (rc != 0 || addrs_.empty()) {
        finish(Error(fmt::format("address resolution failed for {}:{}: {}", addr_.host,
                                 addr_.port, gai_strerror(rc != 0 ? rc : EAI_NONAME))));
        return;
    }
    try_address(0);
}

// Opens all `count_` connections to address `i`; on any failure the next
// address is tried, as QEMU's inet_connect_saddr() walks getaddrinfo's list.
void SocketConnect::try_address(size_t i)
{
    current_ = i;
    fds_.clear();
    fds_.resize(count_);
    error_.reset();
    launching_ = true; // a connect failing at once must not end the round early
    for (unsigned k = 0; k < count_; k++) {
        auto *a = new Attempt;
        a->owner = shared_from_this();
        a->index = k;
        a->h.init(loop_, addr_.type, a);
        pending_.push_back(a);
        if (addr_.type == SocketAddress::Type::Unix) {
            uv_pipe_connect(&a->req, &a->h.pipe, addr_.path.c_str(), on_connect);
            continue; // errors come through on_connect
        }
        int rc = uv_tcp_connect(&a->req, &a->h.tcp, reinterpret_cast<const sockaddr *>(&addrs_[i]),
                                on_connect);
        if (rc != 0) {
            connected(a, rc);
        }
    }
    launching_ = false;
    round_done();
}

void SocketConnect::on_connect(uv_connect_t *req, int status)
{
    auto *a = reinterpret_cast<Attempt *>(req);
    a->owner->connected(a, status);
}

void SocketConnect::connected(Attempt *a, int status)
{
    if (status == 0 && !cancelled_) {
        uv_os_fd_t ufd;
        uv_fileno(a->h.handle(), &ufd);
        auto fd = take_blocking_socket(ufd);
        if (fd) {
            fds_[a->index] = std::move(*fd);
        } else if (!error_) {
            error_ = fd.error();
        }
    } else if (status < 0 && !error_) {
        // QEMU's text: strerror() ("Connection refused"), not libuv's.
        error_.emplace(fmt::format("Failed to connect to '{}': {}", addr_.display(),
                                   std::strerror(-status)));
    }
    pending_.erase(std::find(pending_.begin(), pending_.end(), a));
    if (!uv_is_closing(a->h.handle())) {
        close_attempt(a);
    }
    round_done();
}

// All connects to the current address are back: done, or the next address.
void SocketConnect::round_done()
{
    if (launching_ || !pending_.empty() || cancelled_) {
        return;
    }
    if (error_) {
        fds_.clear();
        if (current_ + 1 < addrs_.size()) {
            try_address(current_ + 1);
            return;
        }
        finish(*error_);
        return;
    }
    finish(std::move(fds_));
}

void SocketConnect::close_attempt(Attempt *a)
{
    uv_close(a->h.handle(),
             [](uv_handle_t *h) { delete static_cast<Attempt *>(h->data); });
}

void SocketConnect::finish(Result<std::vector<UniqueFd>> r)
{
    Connected done = std::move(done_);
    done_ = nullptr;
    if (done) {
        done(std::move(r));
    }
}

void SocketConnect::cancel()
{
    if (cancelled_) {
        return;
    }
    cancelled_ = true;
    done_ = nullptr;
    lookup_.reset(); // its answer is dropped; the reference it held goes

    for (Attempt *a : pending_) {
        // Closing a connecting handle makes its callback run with ECANCELED.
        close_attempt(a);
    }
    fds_.clear();
}

} // namespace qmigd
