// A migration channel's socket itself: blocking dups of libuv's sockets, a
// second connection to the same peer, dead-link and buffer options, and the
// guard that lets any thread end a write blocked on a peer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "daemon/io/unique_fd.h"
#include "daemon/thread_safety.h"
#include "protocol/error.h"

namespace qmigd {

// A blocking write to a peer that cancel and quit can always end: a peer
// that stops reading would otherwise hold the writer in send() for ever,
// and whoever joins the writer with it. The writer brackets each write
// with begin()/end(); abort(), from any thread, shuts the write side of
// the socket being written at that moment. After abort() only a small
// write goes, and only once the socket has room for it within
// kAbortedWriteWaitMs: a verdict (the return path's SHUT) still reaches a
// peer that reads, and never waits on one that does not.
//
// Thread ownership: fd_ and aborted_ are guarded by mu_; the writer is
// one thread at a time; abort() and reset() any thread.
class PeerWriteGuard {
public:
    static constexpr int kAbortedWriteWaitMs = 500;
    static constexpr size_t kAbortedWriteMax = 4096;

    // Writer: before writing n bytes on fd; an error instead of a write
    // that could block once aborted.
    Status begin(int fd, size_t n);
    // Writer: the write returned.
    void end();
    // Any thread: ends the write in progress and bounds the later ones.
    void abort();
    // Before a new migration's writer starts.
    void reset();

private:
    Mutex mu_;
    int fd_ GUARDED_BY(mu_) = -1; // being written
    bool aborted_ GUARDED_BY(mu_) = false;
};

// The functions below that take an `int fd` use it during the call only:
// a borrow of a descriptor its owner (a UniqueFd, a Channel) keeps open.

// Bytes that came on a socket and are not read yet (0 on an error).
size_t bytes_queued(int fd);
// Wakes a thread blocked on fd (shutdown both directions); idempotent.
void shutdown_fd(int fd);

// The return path is the main channel's socket read the other way: a file
// or a pipe has none. QEMU's qemu_file_get_return_path() needs a socket too.
Status return_path_check(int fd);
// Makes a dup of a libuv-owned socket that blocks, with TCP_NODELAY.
Result<UniqueFd> take_blocking_socket(int uv_fd);
// A new connection to where `main` is connected (postcopy's preempt channel
// goes to the main channel's address), blocking and with TCP_NODELAY;
// fails after timeout_ms (0: as long as the kernel tries). `main` is only
// read (getpeername), while its owner keeps it.
Result<UniqueFd> connect_to_peer(const UniqueFd &main, unsigned timeout_ms);
// Dead-link detection on a migration socket: a channel whose peer stops
// acknowledging (sent data, or keepalive probes while idle) for `ms` fails
// with ETIMEDOUT instead of waiting as long as the kernel retransmits
// (about 15 minutes, which is what QEMU 10 does). 0 leaves the defaults.
void set_link_timeout(int fd, unsigned ms);
// True for a TCP socket whose peer is on this host (a loopback address, or
// the socket's own local address).
bool peer_is_local(int fd);
// Caps a socket's send buffer at `bytes` (SO_SNDBUF; the kernel doubles it
// for its bookkeeping). Why, for a peer on this host: with the default
// autotuning (up to 4 MiB a socket) the pages a sender copies into the
// socket are out of the cache by the time the receiver copies them out;
// with a few hundred KiB in flight they are still there. A bare 4-stream
// copy of 2 GiB between hugetlbfs mappings: one page in three 0.42 -> 0.31 s,
// every page 0.58 -> 0.40 s, alike from 64 KiB to 512 KiB (the receive
// buffer's size made no difference). qmigd -> qmigd, 2 GiB, 4 channels,
// 128 KiB: hugetlbfs mixed 0.41 -> 0.31 s, random 0.56 -> 0.53 s; huge-page
// tmpfs mixed 0.58 -> 0.30 s; /dev/shm mixed 0.78 -> 0.64 s; 32 KiB was
// slower than any. Across a network a capped window would cap throughput
// at buffer / round trip, so only a local peer gets it.
void set_send_buffer(int fd, unsigned bytes);

} // namespace qmigd
