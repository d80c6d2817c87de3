// The QMP server: sessions on a unix socket, negotiation, checked dispatch, events.
#include "monitor/qmp_server.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "monitor/json_parse.h"
#include "monitor/json_splitter.h"
#include "monitor/qapi_visit.h"

namespace qmigd {

namespace {

// Replies queued for a client that does not read them: past this, stop
// reading its requests until they drain (QEMU suspends such a monitor).
constexpr size_t kMaxQueuedOutput = 1 << 20;

struct WriteReq {
    uv_write_t req;
    std::string data;
};

json qmp_greeting()
{
    return {{"QMP",
             {{"version",
               {{"qemu", {{"micro", 2}, {"minor", 0}, {"major", 10}}},
                {"package", "qmigd " QMIGD_VERSION}}},
              {"capabilities", json::array({"oob"})}}}};
}

json error_reply(const QmpError &e)
{
    return {{"error", {{"class", e.cls}, {"desc", e.desc}}}};
}

} // namespace

struct QmpServer::Client {
    explicit Client(QmpServer &s) : server(&s), session(s) {}
    ~Client() { set_received(-1); }
    // Keeps only the newest descriptor, as QEMU's socket chardev does.
    void set_received(int fd)
    {
        if (received_fd >= 0) {
            ::close(received_fd);
        }
        received_fd = fd;
    }
    uv_pipe_t pipe; // an IPC pipe: it takes descriptors (SCM_RIGHTS) too
    QmpServer *server;
    QmpSession session;
    bool closing = false;
    bool reading = false; // false while its unread replies back up
    int received_fd = -1; // last SCM_RIGHTS descriptor not yet taken
};


QmpServer::QmpServer(uv_loop_t *loop) : loop_(loop) {}

QmpServer::~QmpServer() = default;

void QmpServer::register_command(const std::string &name, const QapiType *args,
                                 QmpHandler handler, bool allow_oob)
{
    commands_[name] = Command{args, std::move(handler), allow_oob};
}

std::vector<std::string> QmpServer::command_names() const
{
    std::vector<std::string> names;
    for (const auto &kv : commands_) {
        names.push_back(kv.first);
    }
    return names;
}

namespace {

// libuv's pipe bind reports a missing directory as EACCES: say what it is.
std::string bind_error(const std::string &path, int rc)
{
    if (rc == UV_EACCES) {
        std::string dir = path.substr(0, path.find_last_of('/') + 1);
        struct stat st;
        if (!dir.empty() && ::stat(dir.c_str(), &st) != 0 && errno == ENOENT) {
            return std::strerror(ENOENT);
        }
    }
    return uv_strerror(rc);
}

} // namespace

Status QmpServer::listen(const std::string &path)
{
    if (path.size() >= sizeof(sockaddr_un::sun_path)) {
        return Error(fmt::format("UNIX socket path '{}' is too long", path));
    }
    path_ = path;
    ::unlink(path.c_str());
    listener_ = new uv_pipe_t;
    uv_pipe_init(loop_, listener_, 0);
    listener_->data = this;
    int rc = uv_pipe_bind(listener_, path.c_str());
    if (rc == 0) {
        rc = uv_listen(reinterpret_cast<uv_stream_t *>(listener_), 16, on_connection);
    }
    if (rc != 0) {
        uv_close(reinterpret_cast<uv_handle_t *>(listener_),
                 [](uv_handle_t *h) { delete reinterpret_cast<uv_pipe_t *>(h); });
        listener_ = nullptr;
        return Error("cannot listen on QMP socket '" + path + "': " + bind_error(path, rc));
    }
    return {};
}

void QmpServer::on_connection(uv_stream_t *listener, int status)
{
    auto *self = static_cast<QmpServer *>(listener->data);
    if (status < 0) {
        spdlog::warn("qmp: accept failed: {}", uv_strerror(status));
        return;
    }
    auto *c = new Client(*self);
    uv_pipe_init(self->loop_, &c->pipe, 1);
    c->pipe.data = c;
    if (uv_accept(listener, reinterpret_cast<uv_stream_t *>(&c->pipe)) != 0) {
        uv_close(reinterpret_cast<uv_handle_t *>(&c->pipe),
                 [](uv_handle_t *h) { delete static_cast<Client *>(h->data); });
        return;
    }
    self->clients_.push_back(c);
    self->send(c, qmp_greeting());
    start_reading(c);
}

void QmpServer::start_reading(Client *c)
{
    c->reading = true;
    uv_read_start(
        reinterpret_cast<uv_stream_t *>(&c->pipe),
        [](uv_handle_t *, size_t suggested, uv_buf_t *buf) {
            buf->base = new char[suggested];
            buf->len = suggested;
        },
        [](uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
            auto *cl = static_cast<Client *>(s->data);
            std::unique_ptr<char[]> owned(buf->base);
            if (nread < 0) {
                cl->server->drop(cl);
                return;
            }
            cl->server->take_passed_fds(cl);
            cl->server->serving_ = cl;
            auto replies = cl->session.feed(buf->base, size_t(nread));
            cl->server->serving_ = nullptr;
            for (const json &reply : replies) {
                cl->server->send(cl, reply);
            }
            cl->server->throttle(cl);
        });
}

int QmpServer::take_client_fd()
{
    if (!serving_) {
        return -1;
    }
    int fd = serving_->received_fd;
    serving_->received_fd = -1;
    return fd;
}

// Moves the descriptors libuv queued with the bytes just read into the
// client (the newest wins); each comes out through a scratch handle.
void QmpServer::take_passed_fds(Client *c)
{
    while (uv_pipe_pending_count(&c->pipe) > 0) {
        auto *scratch = new uv_pipe_t;
        uv_pipe_init(loop_, scratch, 0);
        uv_os_fd_t fd = -1;
        int rc = uv_accept(reinterpret_cast<uv_stream_t *>(&c->pipe),
                           reinterpret_cast<uv_stream_t *>(scratch));
        if (rc == 0 && uv_fileno(reinterpret_cast<uv_handle_t *>(scratch), &fd) == 0) {
            c->set_received(fcntl(fd, F_DUPFD_CLOEXEC, 0));
        }
        uv_close(reinterpret_cast<uv_handle_t *>(scratch),
                 [](uv_handle_t *h) { delete reinterpret_cast<uv_pipe_t *>(h); });
        if (rc != 0) {
            break; // libuv dropped it; never spin on a queue that does not shrink
        }
    }
}

bool QmpServer::has_command(const std::string &name) const
{
    return commands_.count(name) > 0;
}

bool QmpServer::allows_oob(const std::string &name) const
{
    auto it = commands_.find(name);
    return it != commands_.end() && it->second.allow_oob;
}

QmpResult QmpServer::dispatch(const std::string &name, const json &args)
{
    auto it = commands_.find(name);
    if (it == commands_.end()) {
        return qmp_error("The command " + name + " has not been found", "CommandNotFound");
    }
    if (it->second.args) {
        if (auto e = qapi_check(args, *it->second.args, "", "")) {
            return *e;
        }
    }
    return it->second.handler(args);
}

std::vector<json> QmpSession::feed(const char *data, size_t len)
{
    std::vector<json> replies;
    for (auto &piece : splitter_.feed(data, len)) {
        replies.push_back(piece.error.empty() ? handle(piece.text)
                                              : error_reply({"GenericError", piece.error}));
    }
    return replies;
}

namespace {

// qmp_capabilities' arguments (qapi/control.json).
const QapiType kQmpCapability = qapi_enum({"oob"});
const QapiType kQmpCapabilityList = qapi_list_of(&kQmpCapability);
const QapiType kQmpCapabilitiesArgs = qapi_struct({{"enable", &kQmpCapabilityList, true}});

// QEMU's QDict hash (tdb_hash): it decides the order QEMU visits a
// request's members in, and so which of two bad members its error names.
unsigned qdict_hash(const std::string &name)
{
    unsigned value = 0x238F13AFu * unsigned(name.size());
    for (unsigned i = 0; i < name.size(); i++) {
        value = value + (unsigned(uint8_t(name[i])) << (i * 5 % 24));
    }
    return 1103515243u * value + 12345u;
}

// Members in QDict iteration order: by bucket (512 of them), and within a
// bucket the member parsed last first (QEMU inserts at the list head).
std::vector<std::string> qdict_order(std::vector<std::string> keys)
{
    std::reverse(keys.begin(), keys.end());
    std::stable_sort(keys.begin(), keys.end(), [](const std::string &a, const std::string &b) {
        return qdict_hash(a) % 512 < qdict_hash(b) % 512;
    });
    return keys;
}

// QEMU's qmp_dispatch_check_obj: each member in QDict order, then the
// missing command. `keys`: the request's members as the text gives them.
// Sets *exec_key to "execute" or "exec-oob".
std::optional<QmpError> check_request(const std::vector<std::string> &keys, const json &req,
                                      bool allow_oob, std::string *exec_key)
{
    exec_key->clear();
    for (const auto &k : qdict_order(keys)) {
        if (k == "execute" || (k == "exec-oob" && allow_oob)) {
            if (!req[k].is_string()) {
                return QmpError{"GenericError", "QMP input member '" + k + "' must be a string"};
            }
            if (!exec_key->empty()) {
                return QmpError{"GenericError", "QMP input member '" + k + "' clashes with '" +
                                                    *exec_key + "'"};
            }
            *exec_key = k;
        } else if (k == "arguments") {
            if (!req[k].is_object()) {
                return QmpError{"GenericError", "QMP input member 'arguments' must be an object"};
            }
        } else if (k != "id") {
            return QmpError{"GenericError", "QMP input member '" + k + "' is unexpected"};
        }
    }
    if (exec_key->empty()) {
        return QmpError{"GenericError", "QMP input lacks member 'execute'"};
    }
    return std::nullopt;
}

} // namespace

// A request is checked as QEMU's monitor does: its members, then the
// command's existence, then out-of-band use, then negotiation state, then
// (in dispatch) the arguments, then the command's own checks.
json QmpSession::handle(const std::string &text)
{
    // One parse; the request's own members are noted in the text's order,
    // which QEMU's checks depend on and json does not keep.
    JsonText parsed = parse_json_text(text);
    json &req = parsed.value;
    if (req.is_discarded()) {
        return error_reply({"GenericError", "JSON parse error, invalid JSON input"});
    }
    if (parsed.duplicate_key) {
        return error_reply({"GenericError", "JSON parse error, duplicate key"});
    }
    const std::vector<std::string> &keys = parsed.top_keys;
    if (!req.is_object()) {
        return error_reply({"GenericError", "QMP input must be a JSON object"});
    }
    json reply;
    std::string exec_key;
    if (auto e = check_request(keys, req, oob_, &exec_key)) {
        reply = error_reply(*e);
    } else {
        QmpResult r = run(req[exec_key], exec_key == "exec-oob",
                          req.value("arguments", json::object()));
        if (auto *e = std::get_if<QmpError>(&r)) {
            reply = error_reply(*e);
        } else {
            reply = {{"return", std::get<json>(r)}};
        }
    }
    if (req.contains("id")) {
        reply["id"] = req["id"];
    }
    return reply;
}

QmpResult QmpSession::run(const std::string &name, bool oob, const json &args)
{
    bool known = name == "qmp_capabilities" || server_.has_command(name);
    if (!negotiated_ && name != "qmp_capabilities") {
        // Before negotiation QEMU knows only qmp_capabilities, and turns
        // its "not found" into this.
        return qmp_error("Expecting capabilities negotiation with 'qmp_capabilities'",
                         "CommandNotFound");
    }
    if (!known) {
        return qmp_error("The command " + name + " has not been found", "CommandNotFound");
    }
    if (oob && !server_.allows_oob(name)) {
        return qmp_error("The command " + name + " does not support OOB");
    }
    if (name == "qmp_capabilities") {
        if (auto e = qapi_check(args, kQmpCapabilitiesArgs, "", "")) {
            return *e; // arguments first, as QEMU's generated marshaller
        }
        return negotiated_ ? qmp_error("Capabilities negotiation is already complete, command "
                                       "ignored",
                                       "CommandNotFound")
                           : negotiate(args);
    }
    return server_.dispatch(name, args);
}

// `args` checked already: `enable` lists only "oob", the one capability.
QmpResult QmpSession::negotiate(const json &args)
{
    oob_ = !args.value("enable", json::array()).empty();
    negotiated_ = true;
    return json::object();
}

// Back-pressure: a client whose replies back up is not read from until
// they drain to half the limit (its requests wait in the socket, bounded by
// the kernel). Events still queue; past 64x the limit the client is gone.
void QmpServer::throttle(Client *c)
{
    if (c->closing) {
        return;
    }
    size_t queued = uv_stream_get_write_queue_size(reinterpret_cast<uv_stream_t *>(&c->pipe));
    if (queued > 64 * kMaxQueuedOutput) {
        spdlog::warn("qmp: client does not read its replies ({} bytes queued); closing it",
                     queued);
        drop(c);
    } else if (c->reading && queued > kMaxQueuedOutput) {
        uv_read_stop(reinterpret_cast<uv_stream_t *>(&c->pipe));
        c->reading = false;
    } else if (!c->reading && queued <= kMaxQueuedOutput / 2) {
        start_reading(c);
    }
}

void QmpServer::send(Client *c, const json &msg)
{
    if (c->closing) {
        return;
    }
    auto *w = new WriteReq;
    // Replies may carry bytes that came off the wire (names in error-desc):
    // invalid UTF-8 becomes U+FFFD rather than an exception.
    w->data = msg.dump(-1, ' ', false, json::error_handler_t::replace) + "\r\n";
    w->req.data = c;
    uv_buf_t buf = uv_buf_init(w->data.data(), unsigned(w->data.size()));
    int rc = uv_write(&w->req, reinterpret_cast<uv_stream_t *>(&c->pipe), &buf, 1,
                      [](uv_write_t *req, int status) {
                          auto *cl = static_cast<Client *>(req->data);
                          delete reinterpret_cast<WriteReq *>(req);
                          if (status == 0) {
                              cl->server->throttle(cl);
                          }
                      });
    if (rc != 0) {
        delete w;
        drop(c);
        return;
    }
    throttle(c);
}

void QmpServer::emit_event(const std::string &name, const json &data)
{
    struct timeval tv;
    gettimeofday(&tv, nullptr);
    json ev = {{"timestamp", {{"seconds", tv.tv_sec}, {"microseconds", tv.tv_usec}}},
               {"event", name}};
    if (!data.is_null()) {
        ev["data"] = data;
    }
    for (auto *c : clients_) {
        if (c->session.negotiated()) {
            send(c, ev);
        }
    }
}

void QmpServer::drop(Client *c)
{
    if (c->closing) {
        return;
    }
    c->closing = true;
    clients_.erase(std::remove(clients_.begin(), clients_.end(), c), clients_.end());
    uv_close(reinterpret_cast<uv_handle_t *>(&c->pipe),
             [](uv_handle_t *h) { delete static_cast<Client *>(h->data); });
}

void QmpServer::drop_clients()
{
    while (!clients_.empty()) {
        drop(clients_.back());
    }
}

void QmpServer::close()
{
    drop_clients();
    if (listener_) {
        uv_close(reinterpret_cast<uv_handle_t *>(listener_),
                 [](uv_handle_t *h) { delete reinterpret_cast<uv_pipe_t *>(h); });
        listener_ = nullptr;
        ::unlink(path_.c_str());
    }
}

} // namespace qmigd
