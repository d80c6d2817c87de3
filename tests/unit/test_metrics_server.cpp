// The /metrics server's bounds with small limits, so each shows in a
// fraction of a second: a full cap cuts its oldest connection and the
// newcomer is answered; a connection sending a byte at a time is cut at
// its deadline; stop() waits neither for clients nor for a loop thread
// that does not answer. (Floods against the daemon: test_metrics_hostile.py.)
#include <catch2/catch.hpp>

#include <chrono>
#include <netinet/in.h>
#include <poll.h>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include "daemon/io/socket_address.h"
#include "daemon/service/metrics_server.h"
#include "waiting.h"

using namespace qmigd;
using Clock = std::chrono::steady_clock;

namespace {

// A libuv loop on a thread of its own, serving the dispatcher's posts.
struct LoopThread {
    uv_loop_t loop;
    std::unique_ptr<LoopDispatcher> dispatcher;
    std::thread thread;

    explicit LoopThread(bool run = true)
    {
        uv_loop_init(&loop);
        dispatcher = std::make_unique<LoopDispatcher>(&loop);
        if (run) {
            thread = std::thread([this] { uv_run(&loop, UV_RUN_DEFAULT); });
        }
    }
    ~LoopThread()
    {
        if (thread.joinable()) {
            dispatcher->post([this] { dispatcher->close(); });
            thread.join();
        } else {
            dispatcher->close();
            uv_run(&loop, UV_RUN_DEFAULT);
        }
        uv_loop_close(&loop);
    }
};

// No assertions in here: get_metrics() runs on a thread of the test's too,
// and Catch's are for the test's own thread.
int connect_to(int port)
{
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa = {};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(uint16_t(port));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::connect(fd, reinterpret_cast<sockaddr *>(&sa), sizeof sa);
    return fd;
}

// Whether the server closed `fd` within `ms` (what it sent is skipped).
bool closed_within(int fd, int ms)
{
    auto end = Clock::now() + std::chrono::milliseconds(ms);
    char buf[4096];
    while (Clock::now() < end) {
        pollfd p = {fd, POLLIN, 0};
        if (::poll(&p, 1, 20) == 1 && ::recv(fd, buf, sizeof buf, MSG_DONTWAIT) <= 0) {
            return true;
        }
    }
    return false;
}

std::string get_metrics(int port)
{
    int fd = connect_to(port);
    std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    std::string answer;
    char buf[4096];
    pollfd p = {fd, POLLIN, 0};
    while (::poll(&p, 1, 3000) == 1) {
        ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) {
            break;
        }
        answer.append(buf, size_t(n));
    }
    ::close(fd);
    return answer;
}

} // namespace

TEST_CASE("metrics: a full cap cuts its oldest connection, and the newcomer is answered")
{
    LoopThread lt;
    MetricsServer server(*lt.dispatcher, [] { return std::string("qmigd_up 1\n"); },
                         {4, std::chrono::milliseconds(60000), 16 << 10});
    REQUIRE(server.start("127.0.0.1:0"));
    int idle[4];
    for (size_t i = 0; i < 4; i++) {
        idle[i] = connect_to(server.port());
        // Accepted in order: the oldest is idle[0].
        REQUIRE(testing::wait_until([&] { return server.accepted() == i + 1; }));
    }
    std::string answer = get_metrics(server.port());
    CHECK(answer.rfind("HTTP/1.1 200", 0) == 0);
    CHECK(answer.find("qmigd_up 1") != std::string::npos);
    CHECK(closed_within(idle[0], 60000));
    // The others kept their place: the newest is still served.
    std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    ::send(idle[3], req.data(), req.size(), MSG_NOSIGNAL);
    char buf[64] = {};
    pollfd p = {idle[3], POLLIN, 0};
    REQUIRE(::poll(&p, 1, 60000) == 1);
    CHECK(std::string(buf, size_t(std::max<ssize_t>(0, ::recv(idle[3], buf, 12, 0))))
          == "HTTP/1.1 200");
    server.stop();
    for (int fd : idle) {
        ::close(fd);
    }
}

TEST_CASE("metrics: a connection sending a byte at a time is cut at its deadline")
{
    LoopThread lt;
    MetricsServer server(*lt.dispatcher, [] { return std::string("qmigd_up 1\n"); },
                         {8, std::chrono::milliseconds(300), 16 << 10});
    REQUIRE(server.start("127.0.0.1:0"));
    int fd = connect_to(server.port());
    auto t0 = Clock::now();
    ::send(fd, "GET /metrics HTTP/1.1\r\nX: ", 26, 0);
    bool cut = false;
    while (!cut && Clock::now() - t0 < std::chrono::seconds(60)) {
        ::send(fd, "a", 1, MSG_NOSIGNAL);
        cut = closed_within(fd, 50);
    }
    auto took = Clock::now() - t0;
    CHECK(cut);
    // Not before its deadline (counted from the accept, which may come a
    // little before t0), and at it rather than never: a latency test, its
    // upper margin 10x for a loaded machine.
    CHECK(took >= std::chrono::milliseconds(250));
    CHECK(took < std::chrono::milliseconds(3000));
    ::close(fd);
}

TEST_CASE("metrics: stop() waits neither for clients nor for a loop that does not answer")
{
    LoopThread lt(false); // nobody runs the loop: a scrape's text never comes
    MetricsServer server(*lt.dispatcher, [] { return std::string(); });
    REQUIRE(server.start("127.0.0.1:0"));
    int slow = connect_to(server.port());
    ::send(slow, "GET /metrics HTTP/1.1\r\nX: ", 26, 0);
    std::thread scrape([&] { get_metrics(server.port()); });
    REQUIRE(testing::wait_until([&] { return server.accepted() == 2; }));
    // Waiting on either would take the scrape's 2 s at least (a stuck
    // client: forever); a latency bound with margin for a loaded machine.
    auto t0 = Clock::now();
    server.stop();
    CHECK(Clock::now() - t0 < std::chrono::milliseconds(1500));
    scrape.join();
    CHECK(closed_within(slow, 60000));
    ::close(slow);
}

TEST_CASE("metrics: the address is parsed as a migration's tcp: address is", "[metrics]")
{
    LoopThread lt;
    MetricsServer server(*lt.dispatcher, [] { return std::string(); });
    // "80abc" was taken as port 80 (std::stoi stops at the first non-digit).
    for (const char *bad : {"127.0.0.1:80abc", "tcp:127.0.0.1:80abc", "127.0.0.1:99999",
                            "127.0.0.1:", "nohost", "127.0.0.1:-1"}) {
        auto st = server.start(bad);
        INFO(bad);
        REQUIRE_FALSE(st);
        CHECK(st.error().message() ==
              std::string("--metrics '") + bad + "': expected HOST:PORT or tcp:HOST:PORT, the "
                                                 "port must be a number up to 65535");
        CHECK_FALSE(parse_socket_uri(std::string("tcp:") + bad).ok());
    }
    REQUIRE(server.start("tcp:[127.0.0.1]:0"));
    CHECK(server.port() > 0);
    server.stop();
}
