// UniqueFd and Channel: ownership of a descriptor, and a shutdown that wakes a blocked thread.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/socket.h>

#include <thread>

#include "daemon/channel.h"
#include "daemon/io/unique_fd.h"

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
    std::thread reader([&] { blocked = right.read_full(buf, 5); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    right.shutdown();
    reader.join();
    CHECK_FALSE(blocked);
    CHECK(is_open(right.fd())); // open until the Channel goes
    CHECK_FALSE(right.read_full(buf, 1)); // later calls fail at once
}
