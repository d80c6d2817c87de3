// TLS credentials (tls-creds-x509) and authz-list objects: loading and checking them.
#include "daemon/tls/tls_creds.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fnmatch.h>
#include <sstream>
#include <sys/stat.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "monitor/qapi_visit.h"

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

// QEMU 10's ObjectOptions for the two types qmigd has (qapi/qom.json and
// qapi/crypto.json): object-add's arguments are checked against it with
// QEMU's own errors before anything reads them.
const QapiType kPolicy = qapi_enum({"deny", "allow"});
const QapiType kAuthzFormat = qapi_enum({"exact", "glob"});
const QapiType kRule =
    qapi_struct({{"match", &kQapiStr}, {"policy", &kPolicy}, {"format", &kAuthzFormat, true}});
const QapiType kRules = qapi_list_of(&kRule);
const QapiType kAuthzList = qapi_struct({{"policy", &kPolicy, true}, {"rules", &kRules, true}});
const QapiType kEndpoint = qapi_enum({"client", "server"});
const QapiType kCredsX509 = qapi_struct({{"verify-peer", &kQapiBool, true},
                                         {"dir", &kQapiStr, true},
                                         {"endpoint", &kEndpoint, true},
                                         {"priority", &kQapiStr, true},
                                         {"sanity-check", &kQapiBool, true},
                                         {"passwordid", &kQapiStr, true}});
const QapiType kObjectType = qapi_enum({"authz-list", "tls-creds-x509"});
const QapiType kObject = [] {
    QapiType t = qapi_flat_union("qom-type", &kObjectType,
                                 {{"authz-list", &kAuthzList}, {"tls-creds-x509", &kCredsX509}});
    t.members.push_back({"id", &kQapiStr});
    return t;
}();

// QEMU's id_wellformed(): a letter, then letters, digits, '-', '.', '_'.
bool qom_id_valid(const std::string &id)
{
    if (id.empty() || !std::isalpha(static_cast<unsigned char>(id[0]))) {
        return false;
    }
    return std::all_of(id.begin(), id.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
    });
}

Status check_object(const json &args)
{
    if (!args.is_object()) {
        return Error("Invalid parameter type, expected: object");
    }
    if (args.contains("qom-type") && args["qom-type"].is_string()) {
        const std::string &type = args["qom-type"].get_ref<const std::string &>();
        if (type != "authz-list" && type != "tls-creds-x509") {
            return Error(
                fmt::format("Parameter 'qom-type' does not accept value '{}'", type));
        }
    }
    if (auto e = qapi_check(args, kObject, "", "")) {
        return Error(e->desc);
    }
    if (!qom_id_valid(args["id"].get_ref<const std::string &>())) {
        return Error("Parameter 'id' expects an identifier");
    }
    return {};
}

Status add_creds(const json &args, std::map<std::string, std::shared_ptr<TlsCreds>> &table)
{
    std::string id = args["id"];
    if (!args.contains("dir")) {
        return Error("Parameter 'dir' is missing");
    }
    std::string dir = args["dir"];
    std::string ep = args.value("endpoint", std::string("client"));
    bool verify = args.value("verify-peer", true);
    auto c = TlsCreds::load(id, dir,
                            ep == "server" ? TlsCreds::Endpoint::Server
                                           : TlsCreds::Endpoint::Client,
                            verify);
    QMIGD_TRY(c);
    table[id] = *c;
    spdlog::info("tls: credentials '{}' loaded from {} ({} endpoint, verify-peer {})", id, dir,
                 ep, verify ? "on" : "off");
    return {};
}

std::shared_ptr<AuthzList> make_authz(const json &args)
{
    std::vector<AuthzList::Rule> rules;
    for (const json &r : args.value("rules", json::array())) {
        rules.push_back({r["match"], r["policy"] == "allow",
                         r.value("format", std::string("exact")) == "glob"});
    }
    return std::make_shared<AuthzList>(args["id"], args.value("policy", "deny") == "allow",
                                       std::move(rules));
}

} // namespace

Status TlsObjects::add(const json &args)
{
    QMIGD_TRY(check_object(args));
    const std::string &id = args["id"].get_ref<const std::string &>();
    if (creds_.count(id) || authz_.count(id)) {
        return Error(fmt::format("attempt to add duplicate property '{}' to object (type "
                                 "'container')",
                                 id));
    }
    if (args["qom-type"] == "tls-creds-x509") {
        return add_creds(args, creds_);
    }
    authz_[id] = make_authz(args);
    return {};
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
