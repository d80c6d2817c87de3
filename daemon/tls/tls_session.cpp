// A TLS session over one blocking migration socket: GnuTLS set up as QEMU checks its peer.
#include "daemon/tls/tls_session.h"

#include <cerrno>
#include <cstring>
#include <ctime>
#include <poll.h>
#include <sys/socket.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <gnutls/x509.h>

#include "protocol/wire.h"

namespace qmigd {

namespace {

// QEMU's default priority string (CONFIG_TLS_PRIORITY).
constexpr const char *kPriority = "NORMAL";

Error tls_error(const char *what, int ret)
{
    return Error(fmt::format("{}: {}", what, gnutls_strerror(ret)));
}

} // namespace

ssize_t TlsSession::push(gnutls_transport_ptr_t p, const void *data, size_t n)
{
    auto *t = static_cast<TlsSession *>(p);
    for (;;) {
        ssize_t r = ::send(t->fd_, data, n, MSG_NOSIGNAL);
        if (r >= 0 || errno != EINTR) {
            return r; // GnuTLS reads this thread's errno (see the header)
        }
    }
}

ssize_t TlsSession::pull(gnutls_transport_ptr_t p, void *data, size_t n)
{
    auto *t = static_cast<TlsSession *>(p);
    if (t->pending_pos_ < t->pending_.size()) {
        size_t k = std::min(n, t->pending_.size() - t->pending_pos_);
        std::memcpy(data, t->pending_.data() + t->pending_pos_, k);
        t->pending_pos_ += k;
        return ssize_t(k);
    }
    for (;;) {
        ssize_t r = ::recv(t->fd_, data, n, 0);
        if (r > 0 && t->received_) {
            t->received_->fetch_add(uint64_t(r), std::memory_order_relaxed);
        }
        if (r >= 0 || errno != EINTR) {
            return r;
        }
    }
}

int TlsSession::pull_timeout(gnutls_transport_ptr_t p, unsigned ms)
{
    auto *t = static_cast<TlsSession *>(p);
    if (t->pending_pos_ < t->pending_.size()) {
        return 1;
    }
    struct pollfd pfd = {t->fd_, POLLIN, 0};
    int timeout = ms == GNUTLS_INDEFINITE_TIMEOUT ? -1 : int(ms);
    for (;;) {
        int r = ::poll(&pfd, 1, timeout);
        if (r >= 0 || errno != EINTR) {
            return r;
        }
    }
}

TlsSession::~TlsSession()
{
    if (s_) {
        gnutls_deinit(s_);
    }
}

Status TlsSession::setup(const TlsCreds &creds, bool server)
{
    int ret = gnutls_init(&s_, server ? GNUTLS_SERVER : GNUTLS_CLIENT);
    if (ret < 0) {
        return tls_error("Cannot initialize TLS session", ret);
    }
    const char *err = nullptr;
    ret = gnutls_priority_set_direct(s_, kPriority, &err);
    if (ret < 0) {
        return tls_error("Unable to set TLS session priority", ret);
    }
    ret = gnutls_credentials_set(s_, GNUTLS_CRD_CERTIFICATE, creds.gnutls());
    if (ret < 0) {
        return tls_error("Cannot set session credentials", ret);
    }
    if (server) {
        gnutls_certificate_server_set_request(s_, creds.verify_peer() ? GNUTLS_CERT_REQUEST
                                                                      : GNUTLS_CERT_IGNORE);
    }
    gnutls_transport_set_ptr(s_, this);
    gnutls_transport_set_push_function(s_, push);
    gnutls_transport_set_pull_function(s_, pull);
    gnutls_transport_set_pull_timeout_function(s_, pull_timeout);
    // A peer that connects and says nothing fails the handshake (and so the
    // migration, on either side) after 40 s instead of holding it forever.
    gnutls_handshake_set_timeout(s_, GNUTLS_DEFAULT_HANDSHAKE_TIMEOUT);
    return {};
}

Status TlsSession::handshake()
{
    int ret;
    do {
        ret = gnutls_handshake(s_);
    } while (ret < 0 && !gnutls_error_is_fatal(ret));
    if (ret < 0) {
        return tls_error("TLS handshake failed", ret);
    }
    if (spdlog::should_log(spdlog::level::debug)) {
        char *desc = gnutls_session_get_desc(s_);
        spdlog::debug("tls: fd {} session {}", fd_, desc ? desc : "?");
        gnutls_free(desc);
    }
    return {};
}

// qcrypto_tls_session_check_certificate(): the chain, each certificate's
// dates, the first one's name.
Status TlsSession::check_peer(bool client, const std::string &hostname)
{
    unsigned status = 0;
    int ret = gnutls_certificate_verify_peers2(s_, &status);
    if (ret < 0) {
        return tls_error("Verify failed", ret);
    }
    if (status) {
        const char *reason = "Invalid certificate";
        if (status & GNUTLS_CERT_INVALID) {
            reason = "The certificate is not trusted";
        }
        if (status & GNUTLS_CERT_SIGNER_NOT_FOUND) {
            reason = "The certificate hasn't got a known issuer";
        }
        if (status & GNUTLS_CERT_REVOKED) {
            reason = "The certificate has been revoked";
        }
        if (status & GNUTLS_CERT_INSECURE_ALGORITHM) {
            reason = "The certificate uses an insecure algorithm";
        }
        return Error(reason);
    }
    unsigned n = 0;
    const gnutls_datum_t *certs = gnutls_certificate_get_peers(s_, &n);
    if (!certs || n == 0) {
        return Error("No certificate peers");
    }
    time_t now = time(nullptr);
    for (unsigned i = 0; i < n; i++) {
        gnutls_x509_crt_t crt;
        gnutls_x509_crt_init(&crt);
        std::unique_ptr<gnutls_x509_crt_int, void (*)(gnutls_x509_crt_t)> guard(
            crt, gnutls_x509_crt_deinit);
        if (gnutls_x509_crt_import(crt, &certs[i], GNUTLS_X509_FMT_DER) < 0) {
            return Error("The certificate could not be parsed");
        }
        if (gnutls_x509_crt_get_expiration_time(crt) < now) {
            return Error("The certificate has expired");
        }
        if (gnutls_x509_crt_get_activation_time(crt) > now) {
            return Error("The certificate is not yet activated");
        }
        if (i == 0) {
            // The whole DN, however long (a name cut short or left empty
            // would be checked against the authz rules as another name), in
            // get_dn2's order, the text QEMU's authz rules match.
            gnutls_datum_t dn{};
            if (int ret = gnutls_x509_crt_get_dn2(crt, &dn); ret < 0) {
                return tls_error("Cannot get client distinguished name", ret);
            }
            peer_name_.assign(reinterpret_cast<const char *>(dn.data), dn.size);
            gnutls_free(dn.data);
            if (client && hostname.empty()) { // a unix: socket without tls-hostname
                return Error("No hostname for certificate validation");
            }
            if (client && !gnutls_x509_crt_check_hostname(crt, hostname.c_str())) {
                return Error(fmt::format("Certificate does not match the hostname {}", hostname));
            }
        }
    }
    return {};
}

Result<std::unique_ptr<TlsSession>> TlsSession::client(const UniqueFd &fd,
                                                       const TlsCreds &creds,
                                                       const std::string &hostname)
{
    std::unique_ptr<TlsSession> t(new TlsSession(fd.get()));
    QMIGD_TRY(t->setup(creds, false));
    QMIGD_TRY(t->handshake());
    if (creds.verify_peer()) {
        QMIGD_TRY(t->check_peer(true, hostname));
    }
    return t;
}

Result<std::unique_ptr<TlsSession>> TlsSession::server(const UniqueFd &fd,
                                                       const TlsCreds &creds,
                                                       const AuthzList *authz,
                                                       std::vector<uint8_t> already_read,
                                                       std::atomic<uint64_t> *received)
{
    std::unique_ptr<TlsSession> t(new TlsSession(fd.get()));
    t->pending_ = std::move(already_read);
    t->received_ = received;
    if (received) {
        received->fetch_add(t->pending_.size(), std::memory_order_relaxed);
    }
    QMIGD_TRY(t->setup(creds, true));
    QMIGD_TRY(t->handshake());
    if (creds.verify_peer()) {
        QMIGD_TRY(t->check_peer(false, ""));
        if (authz && !authz->is_allowed(t->peer_name_)) {
            return Error(fmt::format("TLS x509 authz check for {} is denied", wire_text(t->peer_name_)));
        }
    }
    return t;
}

Result<size_t> TlsSession::read(void *dst, size_t n)
{
    for (;;) {
        ssize_t r = gnutls_record_recv(s_, dst, n);
        if (r >= 0) {
            return size_t(r);
        }
        if (r == GNUTLS_E_PREMATURE_TERMINATION) {
            return size_t(0);
        }
        if (r == GNUTLS_E_INTERRUPTED || r == GNUTLS_E_AGAIN || r == GNUTLS_E_REHANDSHAKE) {
            continue;
        }
        return tls_error("read from migration channel (TLS)", int(r));
    }
}

Status TlsSession::write(const void *buf, size_t n)
{
    const auto *p = static_cast<const uint8_t *>(buf);
    while (n > 0) {
        ssize_t r = gnutls_record_send(s_, p, n);
        if (r == GNUTLS_E_INTERRUPTED || r == GNUTLS_E_AGAIN) {
            continue;
        }
        if (r < 0) {
            return tls_error("write to migration channel (TLS)", int(r));
        }
        p += r;
        n -= size_t(r);
    }
    return {};
}

// Corked: a packet's header and its pages leave as full 16 KiB records,
// not a small record per iovec.
Status TlsSession::writev(const struct iovec *iov, int count)
{
    gnutls_record_cork(s_);
    for (int i = 0; i < count; i++) {
        Status st = write(iov[i].iov_base, iov[i].iov_len);
        if (!st) {
            gnutls_record_uncork(s_, 0);
            return st;
        }
    }
    for (;;) {
        int r = gnutls_record_uncork(s_, GNUTLS_RECORD_WAIT);
        if (r >= 0) {
            return {};
        }
        if (r != GNUTLS_E_INTERRUPTED && r != GNUTLS_E_AGAIN) {
            return tls_error("write to migration channel (TLS)", r);
        }
    }
}

void TlsSession::bye()
{
    gnutls_bye(s_, GNUTLS_SHUT_WR);
}

} // namespace qmigd
