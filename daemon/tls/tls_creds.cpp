#include "daemon/tls/tls_creds.h"

#include <cerrno>
#include <cstring>
#include <fnmatch.h>
#include <sstream>
#include <sys/stat.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace qmigd {

namespace {

// QEMU's qcrypto_tls_creds_get_path(): a required file must exist.
Status access_file(const std::string &path, bool required, bool *present)
{
    struct stat st;
    *present = ::stat(path.c_str(), &st) == 0;
    if (!*present && (required || errno != ENOENT)) {
        return Error(fmt::format("Unable to access credentials {}: {}", path,
                                 std::strerror(errno)));
    }
    return {};
}

// A private key anyone on the host can read is no longer private: refused
// (QEMU itself does not look). Group-readable is a warning only: some
// sites share keys with a service group.
Status check_key_mode(const std::string &path)
{
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
        return Error(fmt::format("Unable to access credentials {}: {}", path,
                                 std::strerror(errno)));
    }
    if (st.st_mode & S_IROTH) {
        return Error(fmt::format("Private key {} is readable by other users (mode {:04o}); "
                                 "make it private (chmod 600)",
                                 path, st.st_mode & 07777));
    }
    if (st.st_mode & S_IRGRP) {
        spdlog::warn("tls: private key {} is readable by its group (mode {:04o})", path,
                     st.st_mode & 07777);
    }
    return {};
}

Status gnutls_status(int ret, const std::string &what)
{
    if (ret < 0) {
        return Error(fmt::format("{}: {}", what, gnutls_strerror(ret)));
    }
    return {};
}

} // namespace

TlsCreds::~TlsCreds()
{
    if (cred_) {
        gnutls_certificate_free_credentials(cred_);
    }
    if (dh_) {
        gnutls_dh_params_deinit(dh_);
    }
}

Result<std::shared_ptr<TlsCreds>> TlsCreds::load(std::string id, std::string dir,
                                                 Endpoint endpoint, bool verify_peer)
{
    std::shared_ptr<TlsCreds> c(new TlsCreds());
    c->id_ = std::move(id);
    c->dir_ = std::move(dir);
    c->endpoint_ = endpoint;
    c->verify_peer_ = verify_peer;
    bool server = endpoint == Endpoint::Server;
    std::string ca = c->dir_ + "/ca-cert.pem";
    std::string cert = c->dir_ + (server ? "/server-cert.pem" : "/client-cert.pem");
    std::string key = c->dir_ + (server ? "/server-key.pem" : "/client-key.pem");
    std::string dh = c->dir_ + "/dh-params.pem";
    bool has_ca, has_cert, has_key, has_dh;
    QMIGD_TRY(access_file(ca, true, &has_ca));
    // A client's own certificate is optional: only a verifying server asks.
    QMIGD_TRY(access_file(cert, server, &has_cert));
    QMIGD_TRY(access_file(key, server, &has_key));
    QMIGD_TRY(access_file(dh, false, &has_dh));

    QMIGD_TRY(gnutls_status(gnutls_certificate_allocate_credentials(&c->cred_),
                            "Cannot allocate credentials"));
    QMIGD_TRY(gnutls_status(gnutls_certificate_set_x509_trust_file(c->cred_, ca.c_str(),
                                                                   GNUTLS_X509_FMT_PEM),
                            "Cannot load CA certificate " + ca));
    if (has_cert && has_key) {
        QMIGD_TRY(check_key_mode(key));
        QMIGD_TRY(gnutls_status(gnutls_certificate_set_x509_key_file(
                                    c->cred_, cert.c_str(), key.c_str(), GNUTLS_X509_FMT_PEM),
                                "Cannot load certificate '" + cert + "' & key '" + key + "'"));
    }
    if (has_dh) {
        gnutls_datum_t data;
        QMIGD_TRY(gnutls_status(gnutls_load_file(dh.c_str(), &data),
                                "Cannot load DH parameters from " + dh));
        gnutls_dh_params_init(&c->dh_);
        int ret = gnutls_dh_params_import_pkcs3(c->dh_, &data, GNUTLS_X509_FMT_PEM);
        gnutls_free(data.data);
        QMIGD_TRY(gnutls_status(ret, "Unable to load DH parameters from " + dh));
        gnutls_certificate_set_dh_params(c->cred_, c->dh_);
    }
    return c;
}

bool AuthzList::is_allowed(const std::string &identity) const
{
    for (const Rule &r : rules_) {
        bool hit = r.glob ? fnmatch(r.match.c_str(), identity.c_str(), 0) == 0
                          : r.match == identity;
        if (hit) {
            return r.allow;
        }
    }
    return allow_;
}

namespace {

using nlohmann::json;

Result<std::string> string_prop(const json &args, const char *key, bool required)
{
    if (!args.contains(key)) {
        if (required) {
            return Error(fmt::format("Parameter '{}' is missing", key));
        }
        return std::string();
    }
    if (!args[key].is_string()) {
        return Error(fmt::format("Invalid parameter type for '{}', expected: string", key));
    }
    return args[key].get<std::string>();
}

Result<bool> policy_prop(const json &v, const char *key)
{
    if (!v.is_string() || (v != "allow" && v != "deny")) {
        return Error(fmt::format("Parameter '{}' does not accept value '{}'", key,
                                 v.is_string() ? v.get<std::string>() : v.dump()));
    }
    return v == "allow";
}

} // namespace

Status TlsObjects::add(const json &args)
{
    auto type = string_prop(args, "qom-type", true);
    QMIGD_TRY(type);
    auto id = string_prop(args, "id", true);
    QMIGD_TRY(id);
    if (creds_.count(*id) || authz_.count(*id)) {
        return Error(fmt::format("attempt to add duplicate property '{}' to object (type "
                                 "'container')",
                                 *id));
    }
    if (*type == "tls-creds-x509") {
        auto dir = string_prop(args, "dir", true);
        QMIGD_TRY(dir);
        auto ep = string_prop(args, "endpoint", false);
        QMIGD_TRY(ep);
        if (!ep->empty() && *ep != "client" && *ep != "server") {
            return Error(fmt::format("Parameter 'endpoint' does not accept value '{}'", *ep));
        }
        bool verify = true;
        if (args.contains("verify-peer")) {
            if (!args["verify-peer"].is_boolean()) {
                return Error("Invalid parameter type for 'verify-peer', expected: boolean");
            }
            verify = args["verify-peer"];
        }
        auto c = TlsCreds::load(*id, *dir,
                                *ep == "server" ? TlsCreds::Endpoint::Server
                                                : TlsCreds::Endpoint::Client,
                                verify);
        QMIGD_TRY(c);
        creds_[*id] = *c;
        spdlog::info("tls: credentials '{}' loaded from {} ({} endpoint, verify-peer {})", *id,
                     *dir, ep->empty() ? "client" : *ep, verify ? "on" : "off");
        return {};
    }
    if (*type == "authz-list") {
        bool allow = false;
        if (args.contains("policy")) {
            auto p = policy_prop(args["policy"], "policy");
            QMIGD_TRY(p);
            allow = *p;
        }
        std::vector<AuthzList::Rule> rules;
        const json &list = args.contains("rules") ? args["rules"] : json::array();
        if (!list.is_array()) {
            return Error("Invalid parameter type for 'rules', expected: array");
        }
        for (const json &r : list) {
            if (!r.is_object() || !r.contains("match") || !r["match"].is_string() ||
                !r.contains("policy")) {
                return Error("authz-list: each rule needs 'match' (a string) and 'policy'");
            }
            auto p = policy_prop(r["policy"], "policy");
            QMIGD_TRY(p);
            std::string format = r.value("format", "exact");
            if (format != "exact" && format != "glob") {
                return Error(fmt::format("Parameter 'format' does not accept value '{}'", format));
            }
            rules.push_back({r["match"], *p, format == "glob"});
        }
        authz_[*id] = std::make_shared<AuthzList>(*id, allow, std::move(rules));
        return {};
    }
    return Error(fmt::format("Invalid parameter '{}' (qmigd has tls-creds-x509 and authz-list)",
                             *type));
}

Status TlsObjects::add_option(const std::string &spec)
{
    json args = json::object();
    std::stringstream ss(spec);
    std::string item;
    std::getline(ss, item, ',');
    args["qom-type"] = item;
    while (std::getline(ss, item, ',')) {
        size_t eq = item.find('=');
        if (eq == std::string::npos) {
            return Error(fmt::format("--object '{}': expected key=value, got '{}'", spec, item));
        }
        std::string k = item.substr(0, eq), v = item.substr(eq + 1);
        if (k == "verify-peer") {
            args[k] = v == "on" || v == "yes" || v == "true";
        } else {
            args[k] = v;
        }
    }
    return add(args);
}

Status TlsObjects::del(const std::string &id)
{
    if (creds_.erase(id) || authz_.erase(id)) {
        return {};
    }
    return Error(fmt::format("object '{}' not found", id));
}

Result<std::shared_ptr<TlsCreds>> TlsObjects::creds(const std::string &id,
                                                    TlsCreds::Endpoint want) const
{
    auto it = creds_.find(id);
    if (it == creds_.end()) {
        return Error(fmt::format("No TLS credentials with id '{}'", id));
    }
    if (it->second->endpoint() != want) {
        return Error(fmt::format("Expected TLS credentials for a {} endpoint",
                                 want == TlsCreds::Endpoint::Server ? "server" : "client"));
    }
    return it->second;
}

Result<std::shared_ptr<AuthzList>> TlsObjects::authz(const std::string &id) const
{
    auto it = authz_.find(id);
    if (it == authz_.end()) {
        return Error(fmt::format("Cannot find QAuthZ object ID {}", id));
    }
    return it->second;
}

} // namespace qmigd
