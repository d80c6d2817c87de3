#include "daemon/incoming.h"

#include <cstring>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "daemon/socket_io.h"
#include "daemon/io/file_channel.h"
#include "daemon/thread_name.h"
#include "protocol/multifd_compress.h"
#include "protocol/multifd_packet.h"
#include "protocol/wire.h"

namespace qmigd {

namespace {

// The destination's side of the loader: pages go into the images. Pages
// of the main channel come one at a time; consecutive ones are gathered and
// stored with one write (a pwrite, or one pre-fault on the mapped path).
// The run is stored before anything that could touch the same pages: a zero
// page, a MULTIFD_FLUSH (after which channels may rewrite them), the end.
class ImageLoadHandler : public LoadvmHandler {
public:
    static constexpr uint32_t kRunPages = 64;

    using Announce = std::function<Status(const std::vector<RamBlockDesc> &)>;

    ImageLoadHandler(std::vector<RAMBlock> &blocks, MultifdRecvSync *sync,
                     const MappedRamFileIn *file, Announce announce,
                     std::function<Status()> open_rp, std::unique_ptr<ReturnPathOut> &rp)
        : blocks_(blocks), sync_(sync), file_(file), announce_(std::move(announce)),
          open_rp_(std::move(open_rp)), rp_(rp), run_(new uint8_t[kRunPages * TARGET_PAGE_SIZE])
    {
    }
    Status open_return_path() override { return open_rp_(); }
    Status ping(uint32_t value) override { return rp_->pong(value); }
    Status announce_blocks(const std::vector<RamBlockDesc> &descs) override
    {
        return announce_ ? announce_(descs) : LoadvmHandler::announce_blocks(descs);
    }
    Status mapped_ram_block(size_t block, const MappedRamHeader &h) override
    {
        QMIGD_TRY(flush());
        if (!file_) {
            return Error("mapped-ram is not enabled");
        }
        return mapped_ram_load_block(*file_, blocks_[block], h, &file_counts_);
    }
    const MappedRamCounts &file_counts() const { return file_counts_; }
    Status put_page(size_t block, uint64_t offset, const uint8_t *data) override
    {
        bool extends = run_pages_ && block == run_block_ &&
                       offset == run_offset_ + run_pages_ * TARGET_PAGE_SIZE;
        if (!extends || run_pages_ == kRunPages) {
            QMIGD_TRY(flush());
            run_block_ = block;
            run_offset_ = offset;
        }
        std::memcpy(run_.get() + size_t(run_pages_++) * TARGET_PAGE_SIZE, data, TARGET_PAGE_SIZE);
        return {};
    }
    Status zero_page(size_t block, uint64_t offset) override
    {
        QMIGD_TRY(flush());
        return blocks_[block].image->zero_page(offset);
    }
    Status multifd_flush() override
    {
        QMIGD_TRY(flush());
        return sync_ ? sync_->main_flush() : Status(Error("multifd is not enabled"));
    }
    Status flush()
    {
        uint32_t n = run_pages_;
        run_pages_ = 0;
        return n ? blocks_[run_block_].image->write(run_offset_, run_.get(),
                                                    size_t(n) * TARGET_PAGE_SIZE)
                 : Status();
    }

private:
    std::vector<RAMBlock> &blocks_;
    MultifdRecvSync *sync_;
    const MappedRamFileIn *file_; // null unless mapped-ram
    Announce announce_;           // park mode only
    std::function<Status()> open_rp_;
    std::unique_ptr<ReturnPathOut> &rp_; // set by open_rp_
    MappedRamCounts file_counts_;
    std::unique_ptr<uint8_t[]> run_;
    size_t run_block_ = 0;
    uint64_t run_offset_ = 0;
    uint32_t run_pages_ = 0;
};

} // namespace

IncomingMigration::IncomingMigration(uv_loop_t *loop, LoopDispatcher &dispatcher,
                                     std::vector<RAMBlock> &blocks, OnStatus on_status)
    : loop_(loop), dispatcher_(dispatcher), blocks_(blocks), on_status_(std::move(on_status))
{
}

IncomingMigration::~IncomingMigration()
{
    if (child_) {
        child_->kill_now(); // the daemon quits: so does the command, all of it
    }
    if (load_thread_.joinable()) {
        abort_with(Error("daemon shutting down"));
        load_thread_.join();
    }
    cleanup_channels();
}

void IncomingMigration::set_status(MigrationStatus s)
{
    status_ = s;
    on_status_(s);
}

Status IncomingMigration::start(const MigrationAddress &addr, const IncomingParams &params)
{
    if (migration_is_running(status_)) {
        return Error("The incoming migration has already been started");
    }
    if (load_thread_.joinable()) {
        load_thread_.join();
    }
    if (!params.park_dir.empty()) {
        QMIGD_TRY(park_dir_check(params.park_dir));
        if (params.mapped_ram) {
            return Error("A VM cannot be parked from a mapped-ram file");
        }
    }
    params_ = params;
    main_.reset();
    parked_.reset();
    park_ready_ = park_abort_ = false;
    park_descs_.clear();
    // A mapped-ram file has no channels to accept: its readers are threads.
    bool sockets = addr.transport == MigrationAddress::Transport::Socket;
    multifd_.assign(params.multifd && sockets ? params.channels : 0, std::nullopt);
    file_in_ = MappedRamFileIn{};
    error_desc_.clear();
    thread_error_.reset();
    loading_done_ = false;
    rp_open_ = false;
    normal_pages_ = zero_pages_ = bytes_ = 0;
    cancel_requested_ = false;
    runstate_ = "inmigrate";
    for (auto &b : blocks_) {
        b.image->scan_holes();
    }
    child_.reset();
    if (addr.transport != MigrationAddress::Transport::Socket) {
        // The stream is one file or pipe: the main channel at once.
        auto fd = one_channel_open(loop_, addr, false, params.tls.enabled(), fd_source_,
                                   &child_);
        QMIGD_TRY(fd);
        if (params.mapped_ram) {
            if (Status st = open_mapped_ram(addr, *fd); !st) {
                ::close(*fd);
                return st;
            }
        }
        set_status(MigrationStatus::Setup);
        if (params_.tls.enabled()) {
            // fd: (a socket libvirt connected and handed over) or exec:
            // with TLS: the handshake first, as for a listener's connection.
            handshake_on_thread(*fd, {});
            return {};
        }
        main_ = Channel{*fd, {}, nullptr};
        maybe_start();
        return {};
    }
    listener_ = std::make_unique<SocketListener>(
        loop_, 4, [this](PendingConnection *c, const Error *e) { on_prefix(c, e); },
        stranger_limits());
    QMIGD_TRY(listener_->listen(addr.socket));
    spdlog::info("incoming migration: listening on {} (multifd {}, {} channels, compression {})",
                 listener_->address().uri(), params.multifd ? "on" : "off", params.channels,
                 multifd_method(params.compression).name);
    set_status(MigrationStatus::Setup);
    return {};
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
    file_in_.fd = fd;
    file_in_.file_size = uint64_t(st.st_size);
    file_in_.threads = params_.multifd ? std::max(params_.channels, 1u) : 1;
    if (params_.direct_io) {
        auto fds = file_channels_open(addr, false, file_in_.threads, true);
        QMIGD_TRY(fds);
        file_in_.direct_fds = *fds;
    }
    return {};
}

void IncomingMigration::cancel()
{
    if (!migration_is_running(status_)) {
        return;
    }
    cancel_requested_ = true;
    spdlog::info("incoming migration: cancelled by migrate_cancel");
    if (status_ == MigrationStatus::Active) {
        abort_with(Error("migration cancelled")); // finish() reports it
        return;
    }
    cleanup_channels(); // still listening: nothing else runs
    set_status(MigrationStatus::Cancelled);
}

void IncomingMigration::fail_setup(const Error &err)
{
    spdlog::error("incoming migration failed: {}", err.message());
    error_desc_ = err.message();
    cleanup_channels();
    set_status(MigrationStatus::Failed);
}

void IncomingMigration::cleanup_channels()
{
    if (listener_) {
        listener_->close();
        listener_.reset();
    }
    generation_++;
    if (handshakes_) {
        handshakes_->close_all(); // their results still come: tls_ready() closes them
    }
    // An exec: command gets EOF or EPIPE from the close below and ends;
    // it is reaped on the loop whenever it does.
    child_.reset();
    if (main_ && main_->fd >= 0) {
        ::close(main_->fd);
    }
    main_.reset();
    for (int fd : file_in_.direct_fds) {
        ::close(fd);
    }
    file_in_ = MappedRamFileIn{};
    for (auto &ch : multifd_) {
        if (ch && ch->fd >= 0) {
            ::close(ch->fd);
        }
        ch.reset();
    }
}

// QEMU's migration_ioc_process_incoming(): a channel that starts with the
// stream's magic is the main one; with multifd, anything else is a multifd
// channel's init message.
static bool is_main_channel(const std::vector<uint8_t> &prefix)
{
    return prefix.size() >= 4 && get_be32(prefix.data()) == QEMU_VM_FILE_MAGIC;
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

void IncomingMigration::on_prefix(PendingConnection *c, const Error *err)
{
    bool active = status_ == MigrationStatus::Active;
    if (!active && status_ != MigrationStatus::Setup) {
        if (c) {
            c->close();
        }
        return;
    }
    if (err) {
        // Active: a stranger that went away (the channels are the threads').
        if (!active) {
            fail_setup(*err);
        }
        return;
    }
    if (params_.tls.enabled()) {
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
        auto fd = c->take();
        if (fd) {
            extra_connection(prefix, *fd);
        }
        return;
    }
    auto prefix = c->prefix();
    if (params_.multifd && !is_main_channel(prefix) && prefix.size() < MULTIFD_INIT_SIZE) {
        c->want(MULTIFD_INIT_SIZE);
        return;
    }
    auto fd = c->take();
    if (!fd) {
        fail_setup(fd.error());
        return;
    }
    adopt(std::move(prefix), *fd, nullptr);
}

void IncomingMigration::extra_connection(const std::vector<uint8_t> &prefix, int fd)
{
    ::close(fd);
    // A multifd channel of this source: its init message is whole and
    // carries our UUID (any channel id: a source with more channels than
    // we expect is what this reports).
    bool multifd_init = params_.multifd && prefix.size() >= MULTIFD_INIT_SIZE &&
                        multifd_init_decode(prefix.data(), params_.uuid, 256).ok();
    if (!is_main_channel(prefix) && !multifd_init) {
        spdlog::info("incoming migration: closed a connection that is no migration channel");
        return;
    }
    // Threads own the channels now: this is a source opening more
    // channels than we were configured for.
    abort_with(Error(fmt::format("Extra incoming migration connection: the source opened "
                                 "more channels than configured (multifd {}, {} channels)",
                                 params_.multifd ? "on" : "off", params_.channels)));
}

void IncomingMigration::adopt(std::vector<uint8_t> prefix, int fd, std::shared_ptr<TlsSession> tls)
{
    if (status_ == MigrationStatus::Active) {
        extra_connection(prefix, fd);
        return;
    }
    if (!params_.multifd || is_main_channel(prefix)) {
        if (main_) {
            ::close(fd);
            fail_setup(Error(params_.multifd ? "Extra incoming migration connection: a second "
                                               "main channel"
                                             : "Extra incoming migration connection: multifd is "
                                               "off here, but the source opened more than one "
                                               "channel"));
            return;
        }
        main_ = Channel{fd, std::move(prefix), std::move(tls)};
        maybe_start();
        return;
    }
    if (auto st = accept_multifd(prefix, fd, std::move(tls)); !st) {
        ::close(fd);
        fail_setup(st.error());
        return;
    }
    maybe_start();
}

Status IncomingMigration::accept_multifd(const std::vector<uint8_t> &prefix, int fd,
                                         std::shared_ptr<TlsSession> tls)
{
    if (prefix.size() < MULTIFD_INIT_SIZE) {
        return Error("multifd: the channel closed before its init message");
    }
    auto id = multifd_init_decode(prefix.data(), params_.uuid, params_.channels);
    QMIGD_TRY(id);
    if (multifd_[*id]) {
        return Error(fmt::format("multifd: received id '{}' already setup'", *id));
    }
    multifd_[*id] = Channel{fd, {}, std::move(tls)};
    return {};
}

// The listener read a TLS ClientHello's first bytes: the connection goes
// to a handshake thread, those bytes with it.
void IncomingMigration::start_tls(PendingConnection *c)
{
    auto raw = c->prefix();
    auto fd = c->take();
    if (!fd) {
        if (status_ == MigrationStatus::Setup) {
            fail_setup(fd.error());
        }
        return;
    }
    handshake_on_thread(*fd, std::move(raw));
}

// `raw`: the bytes a listener read already (the ClientHello's first ones).
void IncomingMigration::handshake_on_thread(int fd, std::vector<uint8_t> raw)
{
    if (!handshakes_) {
        // Each holds a thread: far fewer than plain connections. A source
        // needs 1 + channels of them, each for a few milliseconds.
        ListenerLimits l = stranger_limits();
        l.max_pending = kMaxTlsHandshakes;
        handshakes_ = std::make_unique<TlsHandshakes>(loop_, dispatcher_, l);
    }
    uint64_t gen = generation_;
    handshakes_->start(fd, [this, gen, fd, raw = std::move(raw)](TlsHandshakes::Heard &heard) {
        std::shared_ptr<TlsSession> tls;
        auto prefix = tls_identify(fd, raw, heard, &tls);
        return TlsHandshakes::Then(
            [this, gen, fd, prefix, tls](bool ended) { tls_ready(gen, fd, prefix, tls, ended); });
    });
}

// Handshake thread: the handshake, then the first decrypted bytes, which
// say what the channel is: a main channel's magic, or a multifd init
// message (64 bytes).
Result<std::vector<uint8_t>> IncomingMigration::tls_identify(int fd, std::vector<uint8_t> raw,
                                                             TlsHandshakes::Heard &heard,
                                                             std::shared_ptr<TlsSession> *tls)
{
    auto t = TlsSession::server(fd, *params_.tls.creds, params_.tls.authz.get(), std::move(raw),
                                &heard);
    if (!t) {
        return t.error();
    }
    *tls = std::move(*t);
    std::vector<uint8_t> p(MULTIFD_INIT_SIZE);
    size_t have = 0, want = 4;
    Result<std::vector<uint8_t>> out = Error("the channel closed before it identified itself");
    while (have < want) {
        auto r = (*tls)->read(p.data() + have, want - have);
        if (!r || *r == 0) {
            out = r ? out : Result<std::vector<uint8_t>>(r.error());
            (*tls)->stop_hearing();
            return out;
        }
        have += *r;
        if (have == 4 && params_.multifd && !is_main_channel(p)) {
            want = MULTIFD_INIT_SIZE;
        }
    }
    (*tls)->stop_hearing();
    p.resize(have);
    return p;
}

void IncomingMigration::tls_ready(uint64_t gen, int fd, Result<std::vector<uint8_t>> prefix,
                                  std::shared_ptr<TlsSession> tls, bool ended)
{
    bool setup = status_ == MigrationStatus::Setup;
    if (gen != generation_ || (!setup && status_ != MigrationStatus::Active)) {
        ::close(fd); // cleaned up or cancelled meanwhile
        return;
    }
    if (prefix) {
        adopt(std::move(*prefix), fd, std::move(tls));
        return;
    }
    ::close(fd);
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
    if (setup && tls) {
        fail_setup(prefix.error());
        return;
    }
    // A failed handshake (QEMU's migration_tls_incoming_handshake): the
    // listener goes on, so that whoever reaches the port without the
    // credentials cannot end the incoming migration. Said at most once a
    // second, with how many more there were.
    uint64_t now = uv_now(loop_);
    if (now - tls_failed_logged_ms_ >= 1000 || !tls_failed_logged_ms_) {
        spdlog::warn("incoming migration: connection closed, still listening: {}{}",
                     prefix.error().message(),
                     tls_failed_quiet_ ? fmt::format(" ({} more since the last such line)",
                                                     tls_failed_quiet_)
                                       : std::string());
        tls_failed_logged_ms_ = now;
        tls_failed_quiet_ = 0;
    } else {
        tls_failed_quiet_++;
    }
}

void IncomingMigration::maybe_start()
{
    if (!main_) {
        return;
    }
    for (const auto &ch : multifd_) {
        if (!ch) {
            return;
        }
    }
    // mapped-ram never sends MULTIFD_FLUSH: its multifd is the file readers.
    bool channels = !multifd_.empty();
    load_cfg_ = LoadvmConfig{params_.machine_type, ram_block_descs(blocks_), channels,
                             params_.mapped_ram, params_.uuid, !params_.park_dir.empty()};
    sync_ = channels ? std::make_unique<MultifdRecvSync>(multifd_.size()) : nullptr;
    set_link_timeout(main_->fd, params_.link_timeout_ms);
    for (const auto &ch : multifd_) {
        set_link_timeout(ch->fd, params_.link_timeout_ms);
    }
    set_status(MigrationStatus::Active);
    spdlog::info("incoming migration: main channel and {} multifd channels connected",
                 multifd_.size());
    load_thread_ = std::thread([this] {
        set_thread_name("mig/dst/main");
        load_thread_main();
    });
}

void IncomingMigration::abort_with(const Error &err)
{
    {
        std::lock_guard<std::mutex> lk(park_mu_);
        park_abort_ = true;
    }
    park_cv_.notify_all();
    {
        std::lock_guard<std::mutex> lk(err_mu_);
        if (!thread_error_) {
            thread_error_ = err;
        }
    }
    if (sync_) {
        sync_->abort();
    }
    // Wake threads blocked in read(); fds stay open until finish(). A
    // pipe cannot be shut down: its writer, the exec: command, goes. With
    // a return path the main socket's write side stays open for the SHUT.
    if (main_) {
        if (rp_open_) {
            ::shutdown(main_->fd, SHUT_RD);
        } else {
            shutdown_fd(main_->fd);
        }
    }
    if (child_) {
        child_->terminate(); // set before the threads started, reset after
    }
    for (const auto &ch : multifd_) {
        if (ch) {
            shutdown_fd(ch->fd);
        }
    }
}

// One receive channel's state, owned by its thread: the packet buffer of
// the File page path and, with multifd-compression, the stream and its
// input buffer.
struct RecvChannelState {
    std::unique_ptr<uint8_t[]> buf{new uint8_t[MULTIFD_PACKET_PAGES * TARGET_PAGE_SIZE]};
    std::unique_ptr<MultiFDDecompressor> decompressor;
    std::unique_ptr<uint8_t[]> zbuf;
};

// Inflates a packet's compressed payload into its pages' places (the
// runs prepare_pages() gave, page by page in offset order).
static Status receive_compressed(ChannelReader &in, RecvChannelState &ch, const MultiFDPacket &p,
                                 const struct iovec *iov, int niov)
{
    struct iovec z = {ch.zbuf.get(), p.next_packet_size};
    QMIGD_TRY(in.readv(&z, 1));
    uint8_t *pages[MULTIFD_PACKET_PAGES];
    uint32_t n = 0;
    for (int k = 0; k < niov; k++) {
        for (size_t off = 0; off < iov[k].iov_len; off += TARGET_PAGE_SIZE) {
            pages[n++] = static_cast<uint8_t *>(iov[k].iov_base) + off;
        }
    }
    return ch.decompressor->decompress(ch.zbuf.get(), p.next_packet_size, pages, n);
}

// Receives a packet's page data into the image (straight into the
// mapping, or through ch.buf and pwrite: the image's page path), and makes
// its zero pages zero.
static Status receive_packet(ChannelReader &in, RamImage &img, const MultiFDPacket &p,
                             RecvChannelState &ch)
{
    for (uint32_t i = 0; i < p.zero_pages; i++) {
        QMIGD_TRY(img.zero_page(p.offsets[p.normal_pages + i]));
    }
    if (!p.normal_pages) {
        return {};
    }
    struct iovec iov[MULTIFD_PACKET_PAGES];
    int niov = 0;
    QMIGD_TRY(img.prepare_pages(p.offsets.data(), p.normal_pages, ch.buf.get(), iov, &niov));
    if (ch.decompressor) {
        QMIGD_TRY(receive_compressed(in, ch, p, iov, niov));
    } else {
        QMIGD_TRY(in.readv(iov, niov));
    }
    return img.commit_pages(p.offsets.data(), p.normal_pages, ch.buf.get());
}

void IncomingMigration::recv_thread_main(size_t id)
{
    ChannelReader in(multifd_[id]->fd, multifd_[id]->tls.get());
    uint8_t header[MULTIFD_PACKET_HEADER_SIZE];
    RecvChannelState ch;
    const MultiFDMethod &method = multifd_method(params_.compression);
    Status st;
    if (params_.compression != MultiFDCompression::None) {
        auto d = method.make_decompressor();
        st = d.status();
        if (d) {
            ch.decompressor = std::move(*d);
            ch.zbuf.reset(new uint8_t[MULTIFD_COMPRESSED_MAX]);
        }
    }
    while (st) {
        auto got = in.read(header, sizeof(header));
        if (!got || *got == 0) {
            if (!got && !loading_done_) {
                st = got.status();
            }
            break; // EOF at a packet boundary: the source is done with us
        }
        const std::vector<RamBlockDesc> *descs = packet_blocks();
        if (!descs) {
            break;
        }
        auto p = multifd_packet_decode(header, *descs, method.flag);
        st = p.status();
        if (st) {
            st = receive_packet(in, *blocks_[p->block].image, *p, ch);
        }
        if (!st) {
            break;
        }
        normal_pages_.fetch_add(p->normal_pages, std::memory_order_relaxed);
        zero_pages_.fetch_add(p->zero_pages, std::memory_order_relaxed);
        bytes_.fetch_add(sizeof(header) + p->data_bytes(), std::memory_order_relaxed);
        if (p->is_sync() && !sync_->channel_sync(id)) {
            break;
        }
    }
    if (!st) {
        abort_with(Error(st.error()).prepend(fmt::format("multifd channel {}: ", id)));
    }
    sync_->channel_closed(id);
}

Status IncomingMigration::park_announce(const std::vector<RamBlockDesc> &descs)
{
    for (size_t i = 0; i < descs.size(); i++) {
        RamBlockSpec spec;
        spec.name = descs[i].idstr;
        spec.path = parked_block_path(params_.park_dir, i, descs[i].idstr);
        spec.size = descs[i].used_length;
        spec.open = ImageOpen::Create;
        // No vm.json here (park_dir_check): a file of that name is what a
        // park that was killed left, never part of a parked VM.
        if (::unlink(spec.path.c_str()) == 0) {
            spdlog::info("incoming migration: removed {}, left by an unfinished park",
                         spec.path);
        }
        auto b = ram_block_open(spec, false);
        QMIGD_TRY(b);
        b->image->scan_holes();
        blocks_.push_back(std::move(*b));
    }
    spdlog::info("incoming migration: parking {} RAM blocks in {}", descs.size(),
                 params_.park_dir);
    {
        std::lock_guard<std::mutex> lk(park_mu_);
        park_descs_ = descs;
        park_ready_ = true;
    }
    park_cv_.notify_all();
    return {};
}

const std::vector<RamBlockDesc> *IncomingMigration::packet_blocks()
{
    if (!load_cfg_.park) {
        return &load_cfg_.blocks;
    }
    std::unique_lock<std::mutex> lk(park_mu_);
    park_cv_.wait(lk, [this] { return park_ready_ || park_abort_; });
    return park_abort_ ? nullptr : &park_descs_;
}

Result<ParkedVm> IncomingMigration::park_finish(LoadvmResult &result)
{
    ParkedVm vm;
    vm.dir = params_.park_dir;
    vm.machine_type = result.machine_type;
    vm.uuid = result.uuid;
    vm.ram_section_id = result.ram_section_id;
    for (const auto &d : park_descs_) {
        vm.blocks.push_back({d.idstr, d.used_length});
    }
    vm.device_state = std::move(result.device_state);
    // Durable before the record names them: the record is the commit.
    for (const auto &b : blocks_) {
        QMIGD_TRY(b.image->sync());
    }
    QMIGD_TRY(parked_vm_write(vm));
    spdlog::info("incoming migration: parked VM '{}' in {}: {} RAM blocks, {} bytes of device "
                 "state",
                 vm.machine_type, vm.dir, vm.blocks.size(), vm.device_state.size());
    vm.device_state_bytes = vm.device_state.size();
    vm.device_state.clear(); // written; the loop keeps only the summary
    return vm;
}

void IncomingMigration::park_discard()
{
    for (size_t i = 0; i < blocks_.size(); i++) {
        ::unlink(parked_block_path(params_.park_dir, i, blocks_[i].desc.idstr).c_str());
    }
    blocks_.clear();
    parked_.reset();
}

void IncomingMigration::load_thread_main()
{
    for (size_t i = 0; i < multifd_.size(); i++) {
        recv_threads_.emplace_back([this, i] {
            set_thread_name("mig/dst/recv_" + std::to_string(i));
            recv_thread_main(i);
        });
    }
    FdInputStream in(main_->fd, main_->prefix, main_->tls.get());
    QEMUFileReader f(in, 256 * 1024);
    ImageLoadHandler::Announce announce;
    if (load_cfg_.park) {
        announce = [this](const std::vector<RamBlockDesc> &d) { return park_announce(d); };
    }
    auto open_rp = [this]() -> Status {
        auto rp = ReturnPathOut::open(main_->fd, main_->tls.get());
        QMIGD_TRY(rp);
        rp_ = std::move(*rp);
        rp_open_ = true; // abort_with() leaves its write side open from now on
        return {};
    };
    ImageLoadHandler handler(blocks_, sync_.get(), params_.mapped_ram ? &file_in_ : nullptr,
                             std::move(announce), open_rp, rp_);
    auto result = qemu_loadvm_state(f, load_cfg_, handler);
    if (result) {
        if (Status st = handler.flush(); !st) {
            result = st.error();
        }
    }
    std::optional<ParkedVm> parked;
    if (result && load_cfg_.park) {
        auto vm = park_finish(*result);
        if (vm) {
            parked = std::move(*vm);
        } else {
            result = vm.error();
        }
    }
    bytes_.fetch_add(f.pos(), std::memory_order_relaxed);
    if (result) {
        normal_pages_.fetch_add(result->normal_pages + handler.file_counts().normal);
        zero_pages_.fetch_add(result->zero_pages + handler.file_counts().zero);
        // Everything the channels carry precedes the last flush; whatever
        // they do now cannot change the outcome.
        loading_done_ = true;
        if (sync_) {
            sync_->abort();
        }
        for (const auto &ch : multifd_) {
            shutdown_fd(ch->fd);
        }
    } else {
        abort_with(result.error());
    }
    for (auto &t : recv_threads_) {
        t.join();
    }
    recv_threads_.clear();
    std::optional<Error> err;
    {
        std::lock_guard<std::mutex> lk(err_mu_);
        err = thread_error_;
    }
    if (rp_) {
        // The verdict, once everything is loaded (and a parked VM durable):
        // QEMU's migration_incoming_state_destroy().
        rp_->shut(!result || err);
        rp_.reset();
    }
    std::string runstate = result ? result->runstate : "inmigrate";
    dispatcher_.post([this, err, runstate, parked = std::move(parked)]() mutable {
        parked_ = std::move(parked);
        finish(err, runstate);
    });
}

void IncomingMigration::finish(std::optional<Error> err, std::string runstate)
{
    if (load_thread_.joinable()) {
        load_thread_.join();
    }
    cleanup_channels();
    sync_.reset();
    if ((cancel_requested_ || err) && !params_.park_dir.empty()) {
        park_discard();
    }
    if (cancel_requested_) {
        set_status(MigrationStatus::Cancelled);
        return;
    }
    if (err) {
        spdlog::error("incoming migration failed: {}", err->message());
        error_desc_ = err->message();
        set_status(MigrationStatus::Failed);
        return;
    }
    runstate_ = runstate;
    spdlog::info("incoming migration completed: {} normal pages, {} zero pages, {} bytes "
                 "received",
                 normal_pages_.load(), zero_pages_.load(), bytes_.load());
    set_status(MigrationStatus::Completed);
}

nlohmann::json IncomingMigration::query() const
{
    using nlohmann::json;
    if (status_ == MigrationStatus::None) {
        return json::object();
    }
    json r = {{"status", migration_status_name(status_)}};
    if (listener_ && listener_->listening()) {
        r["socket-address"] = json::array({socket_address_json(listener_->address())});
    }
    if (status_ == MigrationStatus::Failed && !error_desc_.empty()) {
        r["error-desc"] = error_desc_;
    }
    // qmigd addition: what the destination received.
    r["incoming"] = {{"normal", normal_pages_.load()},
                     {"zero", zero_pages_.load()},
                     {"bytes", bytes_.load()}};
    if (parked_ && status_ == MigrationStatus::Completed) {
        json blocks = json::array();
        for (const auto &b : parked_->blocks) {
            blocks.push_back({{"id", b.idstr}, {"size", b.size}});
        }
        r["parked"] = {{"dir", parked_->dir},
                       {"machine-type", parked_->machine_type},
                       {"blocks", blocks},
                       {"device-state-bytes", parked_->device_state_bytes}};
    }
    return r;
}

} // namespace qmigd
