// A TLS session over one blocking migration socket (QEMU's QIOChannelTLS
// with qcrypto_tls_session_check_credentials): the handshake and the peer
// checks QEMU makes, in its words, then record I/O.
//
// Thread ownership: the handshake on one thread; then one reading thread
// (read()) and one writing thread (write(), writev(), bye()) at a time, which
// may be two threads at once: GnuTLS allows one send and one receive in
// parallel on a session, and the return path's reader reads the main
// channel's session while the migration thread writes it. So pull() and
// pull_timeout() touch only the reader's members (pending_, received_),
// push() only the fd, and neither calls gnutls_transport_set_errno() (one
// errno per session, "unreliable" with two threads, says GnuTLS): GnuTLS
// reads each thread's own errno instead. shutdown_fd() on the socket from
// any thread wakes both, as for plain sockets.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <sys/uio.h>
#include <vector>

#include <gnutls/gnutls.h>

#include "daemon/io/unique_fd.h"
#include "daemon/tls/tls_creds.h"
#include "protocol/error.h"

namespace qmigd {

class TlsSession {
public:
    // Both sides run over `fd`, a socket its owner keeps open for as long
    // as the session lives (a Channel holds both, the session first to go).
    //
    // Source side: checks the server's certificate against the CA and
    // `hostname` (when the creds verify their peer).
    static Result<std::unique_ptr<TlsSession>> client(const UniqueFd &fd, const TlsCreds &creds,
                                                      const std::string &hostname);
    // Destination side: `already_read` are bytes taken off the socket before
    // anyone knew it spoke TLS (the listener's first read); the handshake
    // reads them first. With verify-peer the client must show a certificate
    // the CA signed, and `authz` (may be null) must allow its DN.
    // `received`, if given, counts the bytes the peer sends (already_read
    // included): which stranger has done the least.
    static Result<std::unique_ptr<TlsSession>> server(const UniqueFd &fd, const TlsCreds &creds,
                                                      const AuthzList *authz,
                                                      std::vector<uint8_t> already_read,
                                                      std::atomic<uint64_t> *received = nullptr);
    ~TlsSession();
    TlsSession(const TlsSession &) = delete;
    TlsSession &operator=(const TlsSession &) = delete;

    // Up to n bytes; 0 at the end of the stream (close_notify, or the peer
    // closing without one: QEMU 10 sources do not always say goodbye).
    Result<size_t> read(void *dst, size_t n);
    // All of iov, in records of up to 16 KiB.
    Status writev(const struct iovec *iov, int count);
    Status write(const void *buf, size_t n);
    // Sends close_notify (the end of what we write); errors are ignored: the
    // data was acknowledged by the migration already or does not matter.
    void bye();
    // Ends the updates of server()'s `received` (before the session leaves
    // the handshake's thread: the counter goes with it).
    void stop_counting() { received_ = nullptr; }
    // The peer's certificate DN, once checked ("" without one).
    const std::string &peer_name() const { return peer_name_; }

private:
    TlsSession(int fd) : fd_(fd) {}
    Status setup(const TlsCreds &creds, bool server);
    Status handshake();
    // QEMU's order: chain, dates, then (client) the server's name.
    Status check_peer(bool client, const std::string &hostname);
    static ssize_t push(gnutls_transport_ptr_t p, const void *data, size_t n);
    static ssize_t pull(gnutls_transport_ptr_t p, void *data, size_t n);
    static int pull_timeout(gnutls_transport_ptr_t p, unsigned ms);

    // The number of client()/server()'s fd, a borrow: its UniqueFd may move
    // (into the Channel that then holds this session) but stays open.
    int fd_;
    gnutls_session_t s_ = nullptr; // GnuTLS splits it between reader and writer
    // The reader's (pull()): already_read, handed to GnuTLS first.
    std::vector<uint8_t> pending_;
    size_t pending_pos_ = 0;
    // The handshake thread's, until stop_counting().
    std::atomic<uint64_t> *received_ = nullptr;
    std::string peer_name_; // set by the handshake, then read-only
};

} // namespace qmigd
