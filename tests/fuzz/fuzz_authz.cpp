// libFuzzer target: object-add of an authz-list (or tls-creds-x509) with
// any JSON, then the list asked about a DN. The input is "JSON\0DN": the
// JSON must be refused or accepted with QEMU's schema, never crash; an
// accepted list answers for any DN, and its verdict is the first matching
// rule's or the policy's.
#include <cstdint>
#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

#include "daemon/tls/tls_creds.h"

using namespace qmigd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *p = reinterpret_cast<const char *>(data);
    const char *nul = static_cast<const char *>(std::memchr(p, 0, size));
    std::string text(p, nul ? size_t(nul - p) : size);
    std::string dn = nul ? std::string(nul + 1, size_t(p + size - nul - 1)) : "CN=x";
    auto args = nlohmann::json::parse(text, nullptr, false);
    if (args.is_discarded()) {
        return 0;
    }
    TlsObjects objects;
    if (!objects.add(args).ok() || !args.is_object() || !args.contains("id") ||
        !args["id"].is_string()) {
        return 0;
    }
    auto authz = objects.authz(args["id"].get<std::string>());
    if (authz.ok()) {
        (void)(*authz)->is_allowed(dn);
    }
    if (!objects.del(args["id"].get<std::string>()).ok()) {
        __builtin_trap(); // what was added can be deleted
    }
    return 0;
}
