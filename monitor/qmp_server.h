// A QMP server on a unix socket, speaking QEMU 10's protocol: greeting,
// capabilities negotiation, {"execute","arguments","id"} requests with
// {"return"} / {"error": {"class","desc"}} replies, and events.
//
// Thread ownership: everything here runs on the libuv loop thread that
// owns the server. Other threads reach it only through the daemon's
// uv_async hand-offs.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>
#include <uv.h>

#include "monitor/json_splitter.h"
#include "protocol/error.h"

namespace qmigd {

using json = nlohmann::json;

struct QmpError {
    std::string cls = "GenericError";
    std::string desc;
};

using QmpResult = std::variant<json, QmpError>;
using QmpHandler = std::function<QmpResult(const json &args)>;

inline QmpResult qmp_error(std::string desc, std::string cls = "GenericError")
{
    return QmpError{std::move(cls), std::move(desc)};
}

struct QapiType;
class QmpServer;

// One client's side of the protocol: the JSON stream, capabilities
// negotiation, request checks in QEMU's order, dispatch. No I/O: bytes in,
// replies out, so the whole input path can be tested (and fuzzed) without
// a socket. The server owns the writing.
class QmpSession {
public:
    explicit QmpSession(QmpServer &server) : server_(server) {}
    // Feeds bytes; runs every complete request; returns the replies in order.
    std::vector<json> feed(const char *data, size_t len);
    bool negotiated() const { return negotiated_; }

private:
    json handle(const std::string &text);
    QmpResult run(const std::string &name, bool oob, const json &args);
    QmpResult negotiate(const json &args);

    QmpServer &server_;
    JsonSplitter splitter_;
    bool negotiated_ = false;
    bool oob_ = false; // capability "oob" enabled at negotiation
};

class QmpServer {
public:
    explicit QmpServer(uv_loop_t *loop);
    ~QmpServer();

    // `args`: the command's argument type in QEMU 10's schema (a struct,
    // monitor/qapi_visit.h; kQapiNoArgs for none). Before the handler
    // runs they are checked as QEMU's generated marshaller does, with its
    // words: each member in schema order (missing, or of the wrong type),
    // then members the type does not have; so a handler reads arguments of
    // the right types. nullptr: the handler checks them itself (only
    // object-add, which shares its check with --object). `allow_oob`: the
    // command may come as exec-oob (QEMU's 'allow-oob': true); every
    // command answers on the loop at once, so it runs as any other.
    void register_command(const std::string &name, const QapiType *args, QmpHandler handler,
                          bool allow_oob = false);
    // Runs a command as a QMP client would (used by HMP).
    QmpResult dispatch(const std::string &name, const json &args);
    bool has_command(const std::string &name) const;
    bool allows_oob(const std::string &name) const;
    Status listen(const std::string &path);
    // Sends an event to every client past negotiation.
    void emit_event(const std::string &name, const json &data = nullptr);
    // Closes the listener and all clients (deferred close, uv style).
    void close();
    // Disconnects every client and keeps listening: a yank of the monitor's
    // chardev (QEMU shuts its one client's socket down; no reply goes).
    void drop_clients();
    std::vector<std::string> command_names() const;
    // The descriptor the client being served sent last with SCM_RIGHTS
    // (QEMU's qemu_chr_fe_get_msgfd), now the caller's; -1 if none. Only
    // from within a command handler.
    int take_client_fd();

private:
    struct Client;
    static void on_connection(uv_stream_t *server, int status);
    void send(Client *c, const json &msg);
    static void start_reading(Client *c);
    void take_passed_fds(Client *c);
    void throttle(Client *c);
    void drop(Client *c);

    uv_loop_t *loop_;
    uv_pipe_t *listener_ = nullptr;
    std::string path_;
    struct Command {
        const QapiType *args; // static schema constants
        QmpHandler handler;
        bool allow_oob = false;
    };
    std::map<std::string, Command> commands_;
    std::vector<Client *> clients_;
    Client *serving_ = nullptr; // whose requests run now (take_client_fd)
};

} // namespace qmigd
