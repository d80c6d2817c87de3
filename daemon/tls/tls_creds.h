// TLS objects as QEMU's QOM has them: tls-creds-x509 (credentials loaded
// from a directory laid out as QEMU's: ca-cert.pem, server-cert.pem,
// server-key.pem, client-cert.pem, client-key.pem, optional dh-params.pem)
// and authz-list (which client certificate DNs a server lets in). Created
// by QMP object-add or --object; migrations name them by id in the
// tls-creds and tls-authz parameters.
//
// Thread ownership: the table lives on the loop thread. A migration holds
// shared_ptrs to the objects it started with, read-only from its threads
// (GnuTLS credentials are safe to share between sessions), so object-del
// during a migration cannot pull them away.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gnutls/gnutls.h>
#include <nlohmann/json.hpp>

#include "protocol/error.h"

namespace qmigd {

class TlsCreds {
public:
    enum class Endpoint { Client, Server };
    // Loads the endpoint's files from dir (QEMU's qcrypto_tls_creds_x509_load).
    static Result<std::shared_ptr<TlsCreds>> load(std::string id, std::string dir,
                                                  Endpoint endpoint, bool verify_peer);
    ~TlsCreds();
    TlsCreds(const TlsCreds &) = delete;
    TlsCreds &operator=(const TlsCreds &) = delete;

    const std::string &id() const { return id_; }
    Endpoint endpoint() const { return endpoint_; }
    bool verify_peer() const { return verify_peer_; }
    gnutls_certificate_credentials_t gnutls() const { return cred_; }

private:
    TlsCreds() = default;
    std::string id_, dir_;
    Endpoint endpoint_ = Endpoint::Client;
    bool verify_peer_ = true;
    gnutls_certificate_credentials_t cred_ = nullptr;
    gnutls_dh_params_t dh_ = nullptr;
};

// QEMU's authz-list: rules in order, the first whose match fits the
// client's DN decides; none fits: the list's policy.
class AuthzList {
public:
    struct Rule {
        std::string match;
        bool allow = false;
        bool glob = false; // format "glob" (fnmatch) or "exact"
    };
    AuthzList(std::string id, bool allow_by_default, std::vector<Rule> rules)
        : id_(std::move(id)), allow_(allow_by_default), rules_(std::move(rules))
    {
    }
    const std::string &id() const { return id_; }
    bool is_allowed(const std::string &identity) const;

private:
    std::string id_;
    bool allow_;
    std::vector<Rule> rules_;
};

// What a migration takes from tls-creds, tls-hostname and tls-authz when
// it starts. No creds: no TLS.
struct TlsParams {
    std::shared_ptr<TlsCreds> creds;
    std::string hostname;              // client: the name the server's certificate must carry
    std::shared_ptr<AuthzList> authz;  // server: may be null
    bool enabled() const { return creds != nullptr; }
};

// The objects object-add made, by id.
class TlsObjects {
public:
    // object-add's arguments (qom-type, id and the type's properties).
    Status add(const nlohmann::json &args);
    // --object TYPE,id=ID,key=value,...
    Status add_option(const std::string &spec);
    // object-del: "object 'x' not found" as QEMU.
    Status del(const std::string &id);

    // For a migration: the tls-creds object with the endpoint its role
    // needs, in QEMU's words when it is missing or the wrong kind.
    Result<std::shared_ptr<TlsCreds>> creds(const std::string &id, TlsCreds::Endpoint want) const;
    Result<std::shared_ptr<AuthzList>> authz(const std::string &id) const;

private:
    std::map<std::string, std::shared_ptr<TlsCreds>> creds_;
    std::map<std::string, std::shared_ptr<AuthzList>> authz_;
};

} // namespace qmigd
