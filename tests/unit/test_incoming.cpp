// The destination in-process: IncomingMigration's threads over a socketpair, its loop run here.
//
// The stream is written with protocol/'s encoders into one end of a
// socketpair; the other end is the fd: channel of migrate-incoming. The
// test thread runs the libuv loop (the destination's loop thread) until
// the migration ends: completed, cancelled while loading, failed on a bad
// section at the start or in the middle of RAM; a postcopy load paused and
// recovered over migrate-recover's channel, cancelled or quit while paused.
#include <catch2/catch.hpp>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>

#include "daemon/dest/incoming.h"
#include "daemon/loop_dispatcher.h"
#include "protocol/savevm.h"
#include "tests/unit/fake_loader.h"

using namespace qmigd;

namespace {

constexpr uint64_t kDestBlock = kPostcopyBlock; // postcopy_head()'s too

// A libuv loop run by the test thread; a tick wakes it so that a wait
// can end on its deadline.
struct DestLoop {
    uv_loop_t loop;
    std::unique_ptr<LoopDispatcher> dispatcher;
    uv_timer_t tick;

    DestLoop()
    {
        uv_loop_init(&loop);
        dispatcher = std::make_unique<LoopDispatcher>(&loop);
        uv_timer_init(&loop, &tick);
        uv_timer_start(&tick, [](uv_timer_t *) {}, 10, 10);
    }
    ~DestLoop()
    {
        uv_timer_stop(&tick);
        uv_close(reinterpret_cast<uv_handle_t *>(&tick), nullptr);
        dispatcher->close();
        uv_run(&loop, UV_RUN_DEFAULT);
        uv_loop_close(&loop);
    }
    bool run_until(const std::function<bool()> &done, int ms = 20000)
    {
        auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
        while (!done()) {
            if (std::chrono::steady_clock::now() > until) {
                return false;
            }
            uv_run(&loop, UV_RUN_ONCE);
        }
        return true;
    }
};

// A destination with one block "mem" in /dev/shm, fed by `source` (the
// socketpair's other end).
struct Dest {
    DestLoop loop;
    std::string path = "/dev/shm/qmigd-unit-incoming-" + std::to_string(::getpid()) + ".img";
    std::vector<RAMBlock> blocks;
    std::vector<MigrationStatus> seen;
    int source = -1;
    std::unique_ptr<IncomingMigration> incoming;

    explicit Dest(const IncomingParams &params = {})
    {
        RamBlockSpec spec;
        spec.name = "mem";
        spec.path = path;
        spec.size = kDestBlock;
        spec.open = ImageOpen::Create;
        ::unlink(path.c_str());
        auto b = ram_block_open(spec, false);
        REQUIRE(b.ok());
        blocks.push_back(std::move(*b));
        int sv[2];
        REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
        source = sv[1];
        incoming = std::make_unique<IncomingMigration>(
            &loop.loop, *loop.dispatcher, blocks, [this](MigrationStatus s) { seen.push_back(s); });
        incoming->set_fd_source([fd = sv[0]](const std::string &) { return Result<int>(fd); });
        auto addr = parse_migration_uri("fd:mig");
        REQUIRE(addr.ok());
        REQUIRE(incoming->start(*addr, params).ok());
    }
    ~Dest()
    {
        incoming.reset(); // joins its threads: the loop's posts are all run
        ::close(source);
        ::unlink(path.c_str());
    }
    void send(const std::vector<uint8_t> &bytes) const
    {
        REQUIRE(::write(source, bytes.data(), bytes.size()) == ssize_t(bytes.size()));
    }
    bool ended() const
    {
        MigrationStatus s = incoming->status();
        return s == MigrationStatus::Completed || s == MigrationStatus::Failed ||
               s == MigrationStatus::Cancelled;
    }
    MigrationStatus wait_end()
    {
        REQUIRE(loop.run_until([this] { return ended(); }));
        return incoming->status();
    }
    void wait_status(MigrationStatus s)
    {
        INFO("waiting for " << migration_status_name(s));
        REQUIRE(loop.run_until([&] { return incoming->status() == s; }));
    }
    std::string error_desc() const { return incoming->query().value("error-desc", ""); }
    uint8_t page_byte(uint64_t offset) const
    {
        uint8_t b = 0;
        REQUIRE(blocks[0].image->read(offset, &b, 1).ok());
        return b;
    }
};

// The stream up to RAM's setup section (what a source sends first).
void put_start(ByteWriter &w, const char *section = "ram")
{
    RamBlockDesc mem{"mem", kDestBlock};
    savevm_put_header(w);
    savevm_put_configuration(w, "none");
    savevm_put_section_header(w, QEMU_VM_SECTION_START, 1, section, 0, 4);
    ram_put_mem_size(w, std::span(&mem, 1));
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
}

// One page of `fill` at page 1, a zero page at page 2; `block` names it.
void put_pages(ByteWriter &w, uint8_t fill, const char *block = "mem")
{
    RamBlockDesc mem{block, kDestBlock};
    RamRecordEncoder rec;
    savevm_put_section_continue(w, QEMU_VM_SECTION_PART, 1);
    rec.put_page_header(w, mem, 1 * TARGET_PAGE_SIZE);
    std::vector<uint8_t> page(TARGET_PAGE_SIZE, fill);
    w.bytes(page.data(), page.size());
    rec.put_zero_page(w, mem, 2 * TARGET_PAGE_SIZE);
    ram_put_flag(w, RAM_SAVE_FLAG_EOS);
    savevm_put_footer(w, 1);
}

IncomingParams postcopy_params()
{
    IncomingParams p;
    p.postcopy_ram = true;
    return p;
}

// migrate-recover on a unix socket of this test's own (removed with it).
struct RecoverSocket {
    std::string path = "/tmp/qmigd-unit-recover-" + std::to_string(::getpid()) + ".sock";
    RecoverSocket() { ::unlink(path.c_str()); }
    ~RecoverSocket() { ::unlink(path.c_str()); }
    MigrationAddress address() const
    {
        auto addr = parse_migration_uri("unix:" + path);
        REQUIRE(addr.ok());
        return *addr;
    }
    // The resumed source's new main channel (the caller closes it).
    int connect() const
    {
        int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        REQUIRE(fd >= 0);
        sockaddr_un sa{};
        sa.sun_family = AF_UNIX;
        std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
        REQUIRE(::connect(fd, reinterpret_cast<sockaddr *>(&sa), sizeof(sa)) == 0);
        return fd;
    }
};

// A postcopy load paused: the package read (postcopy-active), then the
// main channel broken by the source's side (`cut`) or by migrate-pause.
void pause_postcopy(Dest &d, bool cut)
{
    d.send(postcopy_head());
    d.wait_status(MigrationStatus::PostcopyActive);
    if (cut) {
        REQUIRE(::shutdown(d.source, SHUT_WR) == 0);
    } else {
        d.incoming->pause();
    }
    d.wait_status(MigrationStatus::PostcopyPaused);
}

} // namespace

TEST_CASE("destination in-process: a whole stream completes", "[dest]")
{
    Dest d;
    std::vector<uint8_t> s;
    ByteWriter w(s);
    put_start(w);
    put_pages(w, 0x5A);
    put_stream_end(w);
    d.send(s);
    CHECK(d.wait_end() == MigrationStatus::Completed);
    CHECK(d.incoming->runstate() == "running");
    CHECK(d.page_byte(1 * TARGET_PAGE_SIZE) == 0x5A);
    CHECK(d.page_byte(2 * TARGET_PAGE_SIZE) == 0);
    CHECK(d.incoming->query()["incoming"]["normal"] == 1);
    CHECK(d.seen.front() == MigrationStatus::Setup);
}

TEST_CASE("destination in-process: migrate_cancel while the load thread waits for bytes",
          "[dest]")
{
    Dest d;
    std::vector<uint8_t> s;
    ByteWriter w(s);
    put_start(w);
    d.send(s); // and nothing more: the load thread blocks in read()
    REQUIRE(d.loop.run_until([&] { return d.incoming->status() == MigrationStatus::Active; }));
    d.incoming->cancel();
    CHECK(d.wait_end() == MigrationStatus::Cancelled);
}

TEST_CASE("destination in-process: a bad section fails the load", "[dest]")
{
    Dest d;
    std::vector<uint8_t> s;
    ByteWriter w(s);
    SECTION("at setup: an unknown section")
    {
        put_start(w, "nosuch");
        d.send(s);
        CHECK(d.wait_end() == MigrationStatus::Failed);
        CHECK(d.error_desc().find("Unknown savevm section or instance 'nosuch'") !=
              std::string::npos);
    }
    SECTION("active: a page of a block that does not exist")
    {
        put_start(w);
        put_pages(w, 0x5A, "other");
        d.send(s);
        CHECK(d.wait_end() == MigrationStatus::Failed);
        CHECK_FALSE(d.error_desc().empty());
    }
}

TEST_CASE("destination in-process: a paused postcopy load goes on over migrate-recover's channel",
          "[dest][postcopy]")
{
    Dest d(postcopy_params());
    RecoverSocket sock;
    bool by_pause = GENERATE(false, true);
    INFO((by_pause ? "paused by migrate-pause" : "the source's side cut"));
    pause_postcopy(d, !by_pause);
    REQUIRE(d.incoming->recover(sock.address()).ok());
    int fd = sock.connect();
    auto tail = postcopy_tail(true);
    REQUIRE(::write(fd, tail.data(), tail.size()) == ssize_t(tail.size()));
    CHECK(d.wait_end() == MigrationStatus::Completed);
    ::close(fd);
    CHECK(d.page_byte(1 * TARGET_PAGE_SIZE) == 0x22);
    CHECK(d.page_byte(2 * TARGET_PAGE_SIZE) == 0);
    CHECK(d.incoming->runstate() == "running");
    CHECK(d.incoming->query()["incoming"]["normal"] == 2);
    std::vector<MigrationStatus> after_pause(
        std::find(d.seen.begin(), d.seen.end(), MigrationStatus::PostcopyPaused), d.seen.end());
    CHECK(after_pause ==
          std::vector<MigrationStatus>{MigrationStatus::PostcopyPaused,
                                       MigrationStatus::PostcopyRecover,
                                       MigrationStatus::PostcopyActive,
                                       MigrationStatus::Completed});
}

TEST_CASE("destination in-process: cancel while postcopy is paused", "[dest][postcopy]")
{
    Dest d(postcopy_params());
    pause_postcopy(d, true);
    SECTION("waiting for migrate-recover") {}
    SECTION("listening for the new main channel")
    {
        RecoverSocket sock;
        REQUIRE(d.incoming->recover(sock.address()).ok());
    }
    d.incoming->cancel();
    CHECK(d.wait_end() == MigrationStatus::Cancelled);
    CHECK(d.incoming->query()["status"] == "cancelled");
}

TEST_CASE("destination in-process: quit while postcopy is paused", "[dest][postcopy]")
{
    Dest d(postcopy_params());
    RecoverSocket sock;
    bool listening = GENERATE(false, true);
    pause_postcopy(d, true);
    if (listening) {
        REQUIRE(d.incoming->recover(sock.address()).ok());
    }
    // The destructor ends the paused load thread and joins it; what the
    // threads posted meanwhile runs on the loop after it and finds it gone.
    d.incoming.reset();
    CHECK(d.loop.run_until([] { return false; }, 50) == false);
}
