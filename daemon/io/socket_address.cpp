// Socket addresses of migration URIs: host and port, or a unix path, as QEMU parses them.
#include "daemon/io/socket_address.h"

#include <cctype>
#include <cstdlib>
#include <sys/un.h>

#include <fmt/format.h>

namespace qmigd {

namespace {

bool starts_with(const std::string &s, const char *prefix)
{
    return s.rfind(prefix, 0) == 0;
}

// QEMU's inet_parse(): ":PORT" (any address), "[V6]:PORT" with a host
// inside the brackets, or "HOST:PORT" with the host up to the first colon;
// a host of at most 64 characters. So "[]:0" is refused rather than taken
// as every interface, and "::1:0" is refused as QEMU refuses it.
Result<SocketAddress> parse_inet(const std::string &rest)
{
    constexpr size_t kMaxHost = 64;
    SocketAddress a;
    size_t port_at;
    if (starts_with(rest, "[")) {
        size_t close = rest.find(']');
        if (close == std::string::npos || close == 1 || close - 1 > kMaxHost ||
            rest.compare(close + 1, 1, ":") != 0) {
            return Error("error parsing IPv6 address '" + rest + "'");
        }
        a.host = rest.substr(1, close - 1);
        port_at = close + 2;
    } else {
        size_t colon = rest.find(':');
        if (colon == std::string::npos || colon > kMaxHost) {
            return Error("error parsing address '" + rest + "'");
        }
        a.host = rest.substr(0, colon);
        port_at = colon + 1;
    }
    std::string port = rest.substr(port_at);
    char *end = nullptr;
    unsigned long p = std::strtoul(port.c_str(), &end, 10);
    if (port.empty() || !std::isdigit(static_cast<unsigned char>(port[0])) || *end != '\0' ||
        p > 65535) {
        return Error("error parsing address '" + rest + "'");
    }
    a.port = uint16_t(p);
    return a;
}

} // namespace

Result<SocketAddress> parse_socket_uri(const std::string &uri)
{
    if (starts_with(uri, "tcp:")) {
        return parse_inet(uri.substr(4));
    }
    if (starts_with(uri, "unix:")) {
        SocketAddress a;
        a.type = SocketAddress::Type::Unix;
        a.path = uri.substr(5);
        return a;
    }
    return Error("unknown migration protocol: " + uri);
}

Status check_unix_path(const std::string &path)
{
    // QEMU allows exactly 108 bytes (no NUL); libuv 1.44 would silently
    // cut such a path to 107, so qmigd refuses it too.
    if (path.size() >= sizeof(sockaddr_un::sun_path)) {
        return Error(fmt::format("UNIX socket path '{}' is too long", path));
    }
    return {};
}

std::string SocketAddress::display() const
{
    return type == Type::Unix ? path : fmt::format("{}:{}", host, port);
}

std::string SocketAddress::uri() const
{
    if (type == Type::Unix) {
        return "unix:" + path;
    }
    return fmt::format("tcp:{}:{}", host, port);
}

} // namespace qmigd

namespace qmigd {

nlohmann::json socket_address_json(const SocketAddress &a)
{
    if (a.type == SocketAddress::Type::Unix) {
        return {{"type", "unix"}, {"path", a.path}};
    }
    std::string host = a.host.empty() ? "0.0.0.0" : a.host;
    bool v6 = host.find(':') != std::string::npos;
    return {{"type", "inet"},
            {"host", host},
            {"port", std::to_string(a.port)},
            {v6 ? "ipv6" : "ipv4", true}};
}

} // namespace qmigd
