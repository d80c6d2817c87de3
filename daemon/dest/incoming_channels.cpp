// The destination's loop side of its channels (QEMU's
// migration_ioc_process_incoming() and migration_tls_incoming_handshake()):
// what a connection is by its first bytes, after a TLS handshake where
// there is one, and what strangers on the port may hold.
#include "daemon/dest/incoming.h"

#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/io/file_channel.h"
#include "daemon/socket_io.h"
#include "protocol/multifd_packet.h"
#include "protocol/wire.h"

namespace qmigd {

// QEMU's migration_ioc_process_incoming(): a channel that starts with the
// stream's magic is the main one; with multifd, anything else is a multifd
// channel's init message.
static bool is_main_channel(const std::vector<uint8_t> &prefix)
{
    return prefix.size() >= 4 && get_be32(prefix.data()) == QEMU_VM_FILE_MAGIC;
}

static bool is_multifd_init(const std::vector<uint8_t> &prefix)
{
    return prefix.size() >= 4 && get_be32(prefix.data()) == MULTIFD_MAGIC;
}

// Said by a destination when the two ends disagree on the multifd
// capability (QEMU 10 says only that the stream ended, or waits).
static Error multifd_off_here()
{
    return Error("a multifd channel arrived but multifd is off here: the source has the "
                 "multifd capability on, this destination has it off: turn it on at both "
                 "ends or neither");
}

// How long a connection may take to identify itself, and how many may be
// trying at once: a source sends its first bytes at once, over TLS after
// a handshake of a few round trips; a dead link is detected no later.
ListenerLimits IncomingMigration::stranger_limits() const
{
    ListenerLimits l;
    if (params_.link_timeout_ms) {
        l.identify_ms = std::min<uint64_t>(l.identify_ms, params_.link_timeout_ms);
    }
    return l;
}

void IncomingMigration::on_prefix(PendingConnection *c)
{
    bool active = loading();
    if (!active && status_ != MigrationStatus::Setup) {
        c->close();
        return;
    }
    if (params_.tls.enabled()) {
        if (size_t whole = tls_record_wanted(c->prefix()); whole > c->prefix().size()) {
            c->want(whole); // no thread for a ClientHello that is not all there
            return;
        }
        start_tls(c);
        return;
    }
    if (active) {
        auto prefix = c->prefix();
        if (params_.multifd && get_be32(prefix.data()) == MULTIFD_MAGIC &&
            prefix.size() < MULTIFD_INIT_SIZE) {
            c->want(MULTIFD_INIT_SIZE); // a whole init message, or a stranger
            return;
        }
        auto dropped = c->take_socket(); // closed on return
        if (dropped) {
            extra_connection(prefix);
        }
        return;
    }
    auto prefix = c->prefix();
    if (params_.multifd && !is_main_channel(prefix) && prefix.size() < MULTIFD_INIT_SIZE) {
        c->want(MULTIFD_INIT_SIZE);
        return;
    }
    auto fd = c->take_socket();
    if (!fd) {
        fail_setup(fd.error());
        return;
    }
    adopt(std::move(prefix), std::make_unique<Channel>(std::move(*fd)));
}

void IncomingMigration::extra_connection(const std::vector<uint8_t> &prefix)
{
    // A multifd channel of this source would carry our UUID (any channel
    // id: a source with more channels than we expect); so does a
    // stranger's copy when we have none of our own (all zeros).
    std::string looks;
    if (!params_.multifd && is_multifd_init(prefix)) {
        looks = multifd_off_here().message();
    } else if (params_.multifd && prefix.size() >= MULTIFD_INIT_SIZE &&
               multifd_init_decode(prefix.data(), params_.uuid, 256).ok()) {
        looks = fmt::format("a multifd channel came past the {} configured here: does the "
                            "source have more multifd channels?",
                            params_.channels);
    } else if (is_main_channel(prefix)) {
        looks = "a second main channel came: is another source migrating to this port?";
    }
    if (outcome_.ignored.empty()) {
        outcome_.ignored = looks;
    }
    ignored_log_.warn(uv_now(loop_), fmt::format("incoming migration: Extra incoming migration "
                                                 "connection; ignoring{}",
                                                 looks.empty() ? "" : " (" + looks + ")"));
}

void IncomingMigration::ignore_connection(const Error &why)
{
    if (outcome_.ignored.empty()) {
        outcome_.ignored = why.message();
    }
    ignored_log_.warn(uv_now(loop_), "incoming migration: ignored a connection that is no "
                                     "channel of this migration: " + why.message());
}

Error IncomingMigration::with_ignored(const Error &err) const
{
    if (outcome_.ignored.empty()) {
        return err;
    }
    return Error(err.message() + " (a connection was ignored: " + outcome_.ignored + ")");
}

void IncomingMigration::adopt(std::vector<uint8_t> prefix, std::unique_ptr<Channel> ch)
{
    if (loading()) {
        ch.reset();
        extra_connection(prefix);
        return;
    }
    if (!params_.multifd && is_multifd_init(prefix)) {
        ch.reset();
        fail_setup(multifd_off_here());
        return;
    }
    if (!params_.multifd || is_main_channel(prefix)) {
        if (run_->has_main()) {
            ch.reset();
            extra_connection(prefix); // a stranger's header, or a second source
            return;
        }
        run_->set_main({std::move(ch), std::move(prefix)});
        maybe_start();
        watch_multifd();
        return;
    }
    if (auto st = accept_multifd(prefix, ch); !st) {
        ch.reset();
        ignore_connection(st.error()); // a stranger's, or a misconfigured source's
        return;
    }
    maybe_start();
}

Status IncomingMigration::accept_multifd(const std::vector<uint8_t> &prefix,
                                         std::unique_ptr<Channel> &ch)
{
    if (prefix.size() < MULTIFD_INIT_SIZE) {
        return Error("multifd: the channel closed before its init message");
    }
    auto id = multifd_init_decode(prefix.data(), params_.uuid, params_.channels);
    QMIGD_TRY(id);
    return run_->add_multifd(*id, ch);
}

void IncomingMigration::watch_multifd()
{
    if (!params_.multifd || !run_->has_main() || loading() || status_ != MigrationStatus::Setup ||
        multifd_wait_) {
        return;
    }
    main_since_ms_ = uv_now(loop_);
    multifd_wait_ = new uv_timer_t;
    uv_timer_init(loop_, multifd_wait_);
    multifd_wait_->data = this;
    uv_timer_start(
        multifd_wait_,
        [](uv_timer_t *t) { static_cast<IncomingMigration *>(t->data)->check_multifd_missing(); },
        50, 50);
}

void IncomingMigration::stop_multifd_watch()
{
    if (multifd_wait_) {
        sweeper_close(&multifd_wait_);
    }
}

// Loop thread, every 50 ms while the multifd channels are missing.
void IncomingMigration::check_multifd_missing()
{
    if (status_ != MigrationStatus::Setup || !run_->has_main()) {
        stop_multifd_watch();
        return;
    }
    size_t have = run_->multifd_arrived();
    int queued = 0;
    if (have == 0 && ::ioctl(run_->main_fd(), FIONREAD, &queued) == 0 && queued > kMainPagesQueued) {
        fail_setup(Error(fmt::format(
            "the main channel carries RAM pages ({} bytes queued) and no multifd channel came: "
            "the source has the multifd capability off, this destination has it on: turn it "
            "on at both ends or neither",
            queued)));
        return;
    }
    // A shorter --link-timeout bounds the wait too: a channel that has
    // not come by then is on a dead link or nowhere.
    uint64_t wait_ms = params_.link_timeout_ms
                           ? std::min<uint64_t>(kMultifdWaitMs, params_.link_timeout_ms)
                           : kMultifdWaitMs;
    if (uv_now(loop_) - main_since_ms_ >= wait_ms) {
        fail_setup(Error(fmt::format(
            "{} of {} multifd channels arrived within {:.3g} s of the main channel: the source "
            "has the multifd capability off? This destination has it on: turn it on at both "
            "ends or neither",
            have, run_->multifd_expected(), double(wait_ms) / 1000)));
    }
}

// How many bytes a TLS connection's first record takes (header and body):
// a connection gets a handshake thread once its whole ClientHello is in. A
// source sends it at once; a stranger that stalls in it holds a place among
// the listener's pending connections, not a thread. Anything that is not a
// TLS handshake record of a plausible length goes to a thread as it is,
// where the handshake fails at once with GnuTLS's words.
size_t IncomingMigration::tls_record_wanted(const std::vector<uint8_t> &prefix)
{
    constexpr uint8_t kHandshakeRecord = 0x16;
    if (prefix.empty() || prefix[0] != kHandshakeRecord) {
        return prefix.size();
    }
    if (prefix.size() < 5) {
        return 5;
    }
    size_t whole = 5 + get_be16(prefix.data() + 3);
    return whole <= PendingConnection::kMaxPrefix ? whole : prefix.size();
}

// The listener read a TLS ClientHello: the connection goes to a handshake
// thread, those bytes with it.
void IncomingMigration::start_tls(PendingConnection *c)
{
    auto raw = c->prefix();
    auto fd = c->take_socket();
    if (!fd) {
        if (status_ == MigrationStatus::Setup) {
            fail_setup(fd.error());
        }
        return;
    }
    handshake_on_thread(std::move(*fd), std::move(raw));
}

// `raw`: the bytes a listener read already (the ClientHello's first ones).
void IncomingMigration::handshake_on_thread(UniqueFd fd, std::vector<uint8_t> raw)
{
    if (!handshakes_) {
        // Each holds a thread: far fewer than plain connections. A source
        // needs 1 + channels of them, each for a few milliseconds.
        ListenerLimits l = stranger_limits();
        l.max_pending = kMaxTlsHandshakes;
        handshakes_ = std::make_unique<TlsHandshakes>(loop_, dispatcher_, l);
    }
    uint64_t gen = generation_;
    // Held here until tls_ready() makes it a Channel (or closed with the
    // work, should its result never come).
    auto owned = std::make_shared<UniqueFd>(std::move(fd));
    size_t already_read = raw.size();
    auto work = [this, gen, owned, raw = std::move(raw), params = params_.tls,
                 multifd = params_.multifd](TlsHandshakes::Progress &progress) {
        auto tls = std::make_shared<std::unique_ptr<TlsSession>>();
        auto prefix = tls_identify(*owned, raw, params, multifd, progress, tls.get());
        return TlsHandshakes::Then([this, gen, owned, prefix, tls](bool ended) {
            auto ch = std::make_unique<Channel>(std::move(*owned), std::move(*tls));
            tls_ready(gen, std::move(ch), prefix, ended);
        });
    };
    handshakes_->start(*owned, already_read, std::move(work));
}

// Handshake thread: the handshake, then the first decrypted bytes, which
// say what the channel is: a main channel's magic, or a multifd init
// message (64 bytes).
Result<std::vector<uint8_t>> IncomingMigration::tls_identify(const UniqueFd &fd,
                                                             std::vector<uint8_t> raw,
                                                             const TlsParams &params, bool multifd,
                                                             TlsHandshakes::Progress &progress,
                                                             std::unique_ptr<TlsSession> *tls)
{
    auto t = TlsSession::server(fd, *params.creds, params.authz.get(), std::move(raw),
                                &progress.bytes);
    if (!t) {
        return t.error();
    }
    *tls = std::move(*t);
    progress.set_identifying();
    std::vector<uint8_t> p(MULTIFD_INIT_SIZE);
    size_t have = 0, want = 4;
    Result<std::vector<uint8_t>> out = Error("the channel closed before it identified itself");
    while (have < want) {
        auto r = (*tls)->read(p.data() + have, want - have);
        if (!r || *r == 0) {
            out = r ? out : Result<std::vector<uint8_t>>(r.error());
            (*tls)->stop_counting();
            return out;
        }
        have += *r;
        if (have == 4 && multifd && !is_main_channel(p)) {
            want = MULTIFD_INIT_SIZE;
        }
    }
    (*tls)->stop_counting();
    p.resize(have);
    return p;
}

void IncomingMigration::tls_ready(uint64_t gen, std::unique_ptr<Channel> ch,
                                  Result<std::vector<uint8_t>> prefix, bool ended)
{
    bool setup = status_ == MigrationStatus::Setup;
    if (gen != generation_ || (!setup && !loading())) {
        return; // cleaned up or cancelled meanwhile: ch closes
    }
    if (prefix) {
        adopt(std::move(*prefix), std::move(ch));
        return;
    }
    bool handshaken = ch->tls() != nullptr;
    ch.reset();
    // fd:'s or exec:'s one channel: nothing else will come.
    if (setup && !listener_) {
        fail_setup(prefix.error());
        return;
    }
    if (ended) {
        return; // a stranger past its deadline or evicted: counted and logged there
    }
    // After a whole handshake the peer holds our CA's certificate (or
    // verify-peer is off): a channel that closes before it identifies
    // itself ends the migration, as a plain one does and QEMU's does.
    if (setup && handshaken) {
        fail_setup(prefix.error());
        return;
    }
    // A failed handshake (QEMU's migration_tls_incoming_handshake): the
    // listener goes on, so that whoever reaches the port without the
    // credentials cannot end the incoming migration. Said at most once a
    // second, with how many more there were.
    tls_failed_log_.warn(uv_now(loop_), "incoming migration: connection closed, still "
                                        "listening: " + prefix.error().message());
}

// The listener is up, or its name did not resolve or bind (`failed`,
// with QEMU's text as error-desc, as a migrate-incoming error would say).
void IncomingMigration::listening(const Status &st)
{
    if (!st) {
        fail_setup(st.error());
        return;
    }
    spdlog::info("incoming migration: listening on {} ({})", listener_->address().uri(),
                 params_.multifd ? fmt::format("multifd, {} channels, compression {}",
                                               params_.channels,
                                               multifd_method(params_.compression).name)
                                 : std::string("main channel only, no multifd"));
}

// The file's size bounds every offset its headers name; direct-io reads
// pages through O_DIRECT descriptors of their own (QEMU opens its multifd
// channels that way), the stream through the buffered one.
Status IncomingMigration::open_mapped_ram(const MigrationAddress &addr, int fd)
{
    struct stat st;
    if (fstat(fd, &st) < 0) {
        return Error(fmt::format("Could not stat '{}': {}", addr.filename, std::strerror(errno)));
    }
    MappedRamFileIn in;
    in.fd = fd;
    in.file_size = uint64_t(st.st_size);
    in.threads = params_.multifd ? std::max(params_.channels, 1u) : 1;
    if (params_.direct_io) {
        auto fds = open_file_channels(addr, false, in.threads, true);
        QMIGD_TRY(fds);
        for (UniqueFd &d : *fds) {
            in.direct_fds.push_back(std::move(d));
        }
    }
    run_->set_file_in(std::move(in));
    return {};
}

void IncomingMigration::cleanup_channels()
{
    stop_multifd_watch();
    if (listener_) {
        listener_->close();
        listener_.reset();
    }
    generation_++;
    if (handshakes_) {
        handshakes_->close_all(); // their results still come: tls_ready() closes them
    }
}

} // namespace qmigd
