// A migration URI, as QEMU 10's migrate_uri_parse() reads it: a socket
// (tcp:, unix:), a command (exec:) or a file (file:). Pure parsing.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "daemon/io/socket_address.h"
#include "monitor/qapi_visit.h"
#include "protocol/error.h"

namespace qmigd {

struct MigrationAddress {
    enum class Transport { Socket, Exec, File, Fd };
    Transport transport = Transport::Socket;
    SocketAddress socket;     // Socket
    std::vector<std::string> argv; // Exec: exec:CMD is /bin/sh -c CMD
    std::string filename;     // File: the stream starts at `offset`
    uint64_t offset = 0;
    std::string fdname;       // Fd: a getfd name or a descriptor number

    std::string uri() const;
    // QEMU's transport_supports_multi_channels(): multifd needs one (a
    // file is one with mapped-ram: every channel writes its own pages).
    bool multi_channel(bool mapped_ram) const
    {
        return transport == Transport::Socket || (transport == Transport::File && mapped_ram);
    }
};

// "tcp:…", "unix:…", "exec:COMMAND", "file:PATH[,offset=SIZE]" or
// "fd:NAME"; anything else is QEMU's "unknown migration protocol: X".
Result<MigrationAddress> parse_migration_uri(const std::string &uri);

// The `channels` argument of migrate and migrate-incoming (QEMU 10's
// MigrationChannel list), as QAPI types: checked before anything else.
const QapiType &migration_channel_list_type();

// The main channel's address from a `channels` list that passed that
// check, with QEMU 10's migrate_channels_parse() errors. Transports QEMU
// has and qmigd not (vsock, rdma) are refused here.
Result<MigrationAddress> migration_channels_address(const json &channels, bool incoming);

// Where fd:NAME gets its descriptor (the monitor's getfd table).
using FdSource = std::function<Result<int>(const std::string &name)>;

// QEMU's migration_channels_and_transport_compatible() for multifd.
// QEMU's migration_channels_and_transport_compatible(): mapped-ram needs a
// seekable transport (a file), multifd a multi-channel one.
Status check_transport_for_multifd(const MigrationAddress &addr, bool multifd, bool mapped_ram);

} // namespace qmigd
