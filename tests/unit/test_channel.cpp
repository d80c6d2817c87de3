// UniqueFd and Channel: ownership of a descriptor, and a shutdown that wakes a blocked thread.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "daemon/channel.h"
#include "daemon/io/file_channel.h"
#include "daemon/io/migration_socket.h"
#include "daemon/io/unique_fd.h"
#include "waiting.h"

using namespace qmigd;

namespace {

bool is_open(int fd) { return fcntl(fd, F_GETFD) != -1; }

std::pair<UniqueFd, UniqueFd> socket_pair()
{
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

} // namespace

TEST_CASE("UniqueFd closes once, when its last owner goes", "[channel]")
{
    auto [a, b] = socket_pair();
    int raw = a.get();
    UniqueFd moved = std::move(a);
    CHECK_FALSE(a.valid());
    CHECK(moved.get() == raw);
    CHECK(is_open(raw));
    moved = std::move(b); // the old descriptor closes, b's is held
    CHECK_FALSE(is_open(raw));
    int released = moved.release();
    CHECK_FALSE(moved.valid());
    CHECK(is_open(released));
    UniqueFd(released).reset();
    CHECK_FALSE(is_open(released));
}

TEST_CASE("Channel carries bytes both ways and its shutdown wakes a blocked reader",
          "[channel]")
{
    auto [a, b] = socket_pair();
    Channel left(std::move(a)), right(std::move(b));
    REQUIRE(left.write("hello", 5));
    char buf[5];
    REQUIRE(right.read_full(buf, 5));
    CHECK(std::string(buf, 5) == "hello");

    Status blocked;
    std::atomic<pid_t> tid{0};
    std::thread reader([&] {
        tid = testing::this_tid();
        blocked = right.read_full(buf, 5);
    });
    REQUIRE(testing::wait_blocked(tid)); // asleep in recv(), nothing to read
    right.shutdown();
    reader.join();
    CHECK_FALSE(blocked);
    CHECK(is_open(right.fd())); // open until the Channel goes
    CHECK_FALSE(right.read_full(buf, 1)); // later calls fail at once
}

TEST_CASE("The channel openers hand over UniqueFds: a file's, a fd: name's, the peer's second "
          "connection",
          "[channel]")
{
    char path[] = "/tmp/qmigd-unit-channel-XXXXXX";
    UniqueFd tmp(mkstemp(path));
    REQUIRE(tmp.valid());
    REQUIRE(write(tmp.get(), "hello", 5) == 5);
    MigrationAddress a;
    a.transport = MigrationAddress::Transport::File;
    a.filename = path;
    a.offset = 2;
    auto f = open_file_channel(a, false);
    REQUIRE(f);
    char got[4] = {};
    CHECK(read(f->get(), got, 3) == 3);
    CHECK(std::string(got) == "llo");
    auto many = open_file_channels(a, false, 3, false);
    REQUIRE(many);
    CHECK(many->size() == 3);
    unlink(path);

    // fd:NAME: the descriptor the monitor kept is the channel's from now on.
    auto [ours, theirs] = socket_pair();
    int named = ours.release();
    a.transport = MigrationAddress::Transport::Fd;
    a.fdname = "chan";
    auto s = open_stream_channel(a, true, [named](const std::string &) { return Result<int>(named); });
    REQUIRE(s);
    CHECK(s->get() == named);
    s = Error("dropped");
    CHECK_FALSE(is_open(named));

    // The preempt channel's way: a new, blocking connection to the peer of one.
    UniqueFd lst(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sin);
    REQUIRE(bind(lst.get(), reinterpret_cast<sockaddr *>(&sin), sizeof(sin)) == 0);
    REQUIRE(listen(lst.get(), 4) == 0);
    REQUIRE(getsockname(lst.get(), reinterpret_cast<sockaddr *>(&sin), &len) == 0);
    UniqueFd main_fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(connect(main_fd.get(), reinterpret_cast<sockaddr *>(&sin), sizeof(sin)) == 0);
    auto second = connect_to_peer(main_fd, 2000);
    REQUIRE(second);
    CHECK((fcntl(second->get(), F_GETFL) & O_NONBLOCK) == 0);
    auto dup = take_blocking_socket(second->get());
    REQUIRE(dup);
    CHECK(dup->get() != second->get());
}
