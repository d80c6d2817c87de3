// Connecting migration channels over stream sockets (TCP and unix), off the loop's back.
#pragma once

#include <functional>
#include <memory>
#include <netdb.h>
#include <optional>
#include <vector>

#include <uv.h>

#include "daemon/io/name_lookup.h"
#include "daemon/io/socket_address.h"
#include "daemon/io/unique_fd.h"
#include "protocol/error.h"

namespace qmigd {

// Connects `count` sockets to addr. An inet name is resolved off the loop
// (NameLookup) and each address tried in turn (QEMU's inet_connect_saddr); a
// unix path is the one address. `done` runs once, with all descriptors
// (blocking, the caller's) or the first error in QEMU's words -- unless
// cancel() came first: it aborts the lookup and the connects at once, and
// `done` never runs. Loop thread only: created, called and called back there.
class SocketConnect : public std::enable_shared_from_this<SocketConnect> {
public:
    using Connected = std::function<void(Result<std::vector<UniqueFd>>)>;
    static std::shared_ptr<SocketConnect> start(uv_loop_t *loop, const SocketAddress &addr,
                                                unsigned count, Connected done);
    void cancel();

private:
    struct Attempt;
    SocketConnect(uv_loop_t *loop, SocketAddress addr, unsigned count, Connected done)
        : loop_(loop), addr_(std::move(addr)), count_(count), done_(std::move(done))
    {
    }
    void resolved(int rc, const std::vector<sockaddr_storage> &addrs);
    static void on_connect(uv_connect_t *req, int status);
    void try_address(size_t i);
    void connected(Attempt *a, int status);
    void round_done();
    static void close_attempt(Attempt *a);
    void finish(Result<std::vector<UniqueFd>> r);

    uv_loop_t *loop_;
    SocketAddress addr_;
    unsigned count_;
    Connected done_;
    std::unique_ptr<NameLookup> lookup_; // while the name is looked up
    std::vector<sockaddr_storage> addrs_;
    size_t current_ = 0;
    std::vector<Attempt *> pending_; // connects in flight
    std::vector<UniqueFd> fds_;      // this round's, by channel
    std::optional<Error> error_;
    bool cancelled_ = false;
    bool launching_ = false;
};

} // namespace qmigd
