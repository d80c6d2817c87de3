// Migration URIs and QMP `channels`: parsing tcp:, unix:, exec:, file: and fd: as QEMU does.
#include "daemon/io/migration_address.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "monitor/qemu_size.h"

namespace qmigd {

Result<MigrationAddress> parse_migration_uri(const std::string &uri)
{
    MigrationAddress a;
    if (uri.rfind("exec:", 0) == 0) {
        a.transport = MigrationAddress::Transport::Exec;
        a.argv = {"/bin/sh", "-c", uri.substr(5)};
        return a;
    }
    if (uri.rfind("fd:", 0) == 0) {
        a.transport = MigrationAddress::Transport::Fd;
        a.fdname = uri.substr(3);
        if (a.fdname.empty()) {
            return Error("invalid file descriptor address");
        }
        return a;
    }
    if (uri.rfind("file:", 0) == 0) {
        // QEMU's file_parse_offset(): the first ",offset=" ends the name.
        a.transport = MigrationAddress::Transport::File;
        a.filename = uri.substr(5);
        size_t opt = a.filename.find(",offset=");
        if (opt != std::string::npos) {
            std::string value = a.filename.substr(opt + 8);
            a.filename.resize(opt);
            int err = 0;
            auto off = qemu_strtosz(value, 0, &err);
            if (!off) {
                return Error(fmt::format("file URI has bad offset {}: {}", value,
                                         std::strerror(err)));
            }
            a.offset = *off;
        }
        return a;
    }
    auto s = parse_socket_uri(uri);
    QMIGD_TRY(s);
    a.socket = *s;
    return a;
}

std::string MigrationAddress::uri() const
{
    switch (transport) {
    case Transport::Exec:
        if (argv.size() == 3 && argv[0] == "/bin/sh" && argv[1] == "-c") {
            return "exec:" + argv[2];
        }
        return fmt::format("exec:{}", fmt::join(argv, " "));
    case Transport::File:
        return offset ? fmt::format("file:{},offset={}", filename, offset) : "file:" + filename;
    case Transport::Fd:
        return "fd:" + fdname;
    case Transport::Socket:
        break;
    }
    return socket.uri();
}

namespace {

const QapiType kStrList = qapi_list_of(&kQapiStr);

// qapi/sockets.json and qapi/migration.json of QEMU 10.0 (10.0.2's query-qmp-schema:
// InetSocketAddress has no keep-alive-count/idle/interval, which came later).
const QapiType kInet = qapi_struct({{"host", &kQapiStr},
                                    {"port", &kQapiStr},
                                    {"numeric", &kQapiBool, true},
                                    {"to", &kQapiUint16, true},
                                    {"ipv4", &kQapiBool, true},
                                    {"ipv6", &kQapiBool, true},
                                    {"keep-alive", &kQapiBool, true},
                                    {"mptcp", &kQapiBool, true}});
const QapiType kUnix =
    qapi_struct({{"path", &kQapiStr}, {"abstract", &kQapiBool, true}, {"tight", &kQapiBool, true}});
const QapiType kVsock = qapi_struct({{"cid", &kQapiStr}, {"port", &kQapiStr}});
const QapiType kFdStr = qapi_struct({{"str", &kQapiStr}});
const QapiType kExec = qapi_struct({{"args", &kStrList}});
const QapiType kFile = qapi_struct({{"filename", &kQapiStr}, {"offset", &kQapiUint64}});
const QapiType kSocketType = qapi_enum({"inet", "unix", "vsock", "fd"});
const QapiType kTransport = qapi_enum({"socket", "exec", "rdma", "file"});
const QapiType kChannelType = qapi_enum({"main", "cpr"});

const QapiType kSocket =
    qapi_flat_union("type", &kSocketType,
               {{"inet", &kInet}, {"unix", &kUnix}, {"vsock", &kVsock}, {"fd", &kFdStr}});
const QapiType kAddress = qapi_flat_union(
    "transport", &kTransport,
    {{"socket", &kSocket}, {"exec", &kExec}, {"rdma", &kInet}, {"file", &kFile}});
const QapiType kChannel = qapi_struct({{"channel-type", &kChannelType}, {"addr", &kAddress}});
const QapiType kChannelList = qapi_list_of(&kChannel);

Result<MigrationAddress> address_from_json(const json &addr)
{
    MigrationAddress a;
    std::string transport = addr["transport"];
    if (transport == "exec") {
        a.transport = MigrationAddress::Transport::Exec;
        a.argv = addr["args"].get<std::vector<std::string>>();
        return a;
    }
    if (transport == "file") {
        a.transport = MigrationAddress::Transport::File;
        a.filename = addr["filename"];
        a.offset = addr["offset"].is_number_unsigned() ? addr["offset"].get<uint64_t>()
                                                         : uint64_t(addr["offset"].get<int64_t>());
        return a;
    }
    std::string type = transport == "socket" ? addr["type"].get<std::string>() : "";
    if (type == "fd") {
        a.transport = MigrationAddress::Transport::Fd;
        a.fdname = addr["str"];
        return a;
    }
    if (type == "unix") {
        a.socket.type = SocketAddress::Type::Unix;
        a.socket.path = addr["path"];
        return a;
    }
    if (type == "inet") {
        // The struct's host may be a bare IPv6 address: bracketed for the
        // URI parser, as QEMU's InetSocketAddress needs none.
        std::string host = addr["host"];
        if (host.find(':') != std::string::npos) {
            host = "[" + host + "]";
        }
        auto s = parse_socket_uri("tcp:" + host + ":" + addr["port"].get<std::string>());
        QMIGD_TRY(s);
        a.socket = *s;
        a.socket.host = addr["host"]; // as given: no [v6] brackets to strip
        return a;
    }
    return Error(fmt::format("qmigd does not support the {} transport",
                             type.empty() ? transport : type));
}

} // namespace

const QapiType &migration_channel_list_type()
{
    return kChannelList;
}

Result<MigrationAddress> migration_channels_address(const json &channels, bool incoming)
{
    // QEMU's migrate_channels_parse(): migrate-incoming takes exactly one
    // (main) channel; migrate one of each type, and needs a main one.
    if (incoming && channels.size() > 1) {
        return Error("Channel list must have only one entry, for type 'main'");
    }
    const json *main = nullptr;
    std::vector<std::string> seen;
    for (const auto &ch : channels) {
        std::string type = ch["channel-type"];
        if (std::find(seen.begin(), seen.end(), type) != seen.end()) {
            return Error("Channel list has more than one " + type + " entry");
        }
        seen.push_back(type);
        if (type == "main") {
            main = &ch;
        }
    }
    if (!main) {
        return Error("Channel list has no main entry"); // QEMU 10.0 crashes here
    }
    return address_from_json((*main)["addr"]);
}

Status check_transport_for_multifd(const MigrationAddress &addr, bool multifd, bool mapped_ram)
{
    if (mapped_ram && addr.transport != MigrationAddress::Transport::File) {
        return Error("Migration requires seekable transport (e.g. file)");
    }
    if (multifd && !addr.multi_channel(mapped_ram)) {
        return Error("Migration requires multi-channel URIs (e.g. tcp)");
    }
    return {};
}

} // namespace qmigd
