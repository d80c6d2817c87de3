// Where a migration stream goes: QEMU's SocketAddress for the `tcp:` and
// `unix:` URIs (migration/migration.c, util/qemu-sockets.c). Pure parsing.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "protocol/error.h"

namespace qmigd {

struct SocketAddress {
    enum class Type { Inet, Unix };
    Type type = Type::Inet;
    std::string host;  // inet: name or address; "" = every interface (listen)
    uint16_t port = 0; // inet; 0 = any (listen)
    std::string path;  // unix

    // QEMU's socket_uri(): "tcp:HOST:PORT" (no brackets) or "unix:PATH".
    std::string uri() const;
    // As QEMU names the peer in errors: "HOST:PORT" or PATH.
    std::string display() const;
};

// Parses "tcp:HOST:PORT" (HOST may be [v6]) or "unix:PATH", with QEMU's
// error texts ("unknown migration protocol: X", "error parsing address 'X'").
Result<SocketAddress> parse_socket_uri(const std::string &uri);

// "UNIX socket path 'X' is too long", checked where QEMU checks it: at
// bind (an error of migrate-incoming) and connect (the migration fails).
Status check_unix_path(const std::string &path);

// QAPI's SocketAddress, as query-migrate's socket-address lists it:
// {"type":"inet","host","port","ipv4"|"ipv6":true} (an empty listen host
// is 0.0.0.0) or {"type":"unix","path"}.
nlohmann::json socket_address_json(const SocketAddress &a);

} // namespace qmigd
