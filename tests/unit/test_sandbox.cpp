// The sandbox's filter as the daemon loads it, tried in a child process
// (a filter cannot be taken off): its allowed calls work, threads start,
// and a forbidden call kills with a line naming it, or fails with EPERM.
#include <catch2/catch.hpp>

#include <cerrno>
#include <csignal>
#include <netinet/in.h>
#include <cstdio>
#include <string>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "daemon/service/sandbox.h"

using namespace qmigd;

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true; // their runtimes make calls of their own
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

struct ChildEnd {
    int status;
    std::string stderr_text;
};

// Runs body in a child whose stderr is captured; body's return is the exit code.
template <typename Body> ChildEnd in_child(Body body)
{
    int p[2];
    REQUIRE(pipe(p) == 0);
    std::fflush(stdout); // or the child's logging writes our buffer again
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        dup2(p[1], STDERR_FILENO);
        close(p[0]);
        close(p[1]);
        _exit(body());
    }
    close(p[1]);
    std::string text;
    char buf[512];
    for (ssize_t n; (n = read(p[0], buf, sizeof buf)) > 0;) {
        text.append(buf, size_t(n));
    }
    close(p[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return {status, text};
}

SandboxOptions parsed(const std::string &text)
{
    SandboxOptions o;
    REQUIRE(sandbox_parse(text, &o));
    return o;
}

} // namespace

TEST_CASE("sandbox options parse as QEMU's -sandbox words")
{
    CHECK_FALSE(parsed("off").on);
    SandboxOptions o = parsed("on");
    CHECK((o.on && !o.spawn && o.kill));
    o = parsed("on,spawn=allow,action=errno");
    CHECK((o.on && o.spawn && !o.kill));
    SandboxOptions bad;
    CHECK_FALSE(sandbox_parse("", &bad));
    CHECK_FALSE(sandbox_parse("yes", &bad));
    CHECK_FALSE(sandbox_parse("on,spawn", &bad));
    CHECK_FALSE(sandbox_parse("on,action=log", &bad));
    CHECK(sandbox_parse("on,obsolete=deny", &bad).error().message().find("unknown option") !=
          std::string::npos);
}

TEST_CASE("the allow-list: threads run, fork kills naming clone, or fails with EPERM")
{
    if (kSanitized) {
        WARN("skipped under a sanitizer: its runtime's calls are not the daemon's");
        return;
    }
    ChildEnd killed = in_child([] {
        if (!sandbox_install(parsed("on"))) {
            return 10;
        }
        if (!sandbox_denies_spawn()) {
            return 11;
        }
        int ran = 0;
        std::thread([&] { ran = 1; }).join(); // clone with CLONE_THREAD
        if (!ran) {
            return 12;
        }
        pid_t pid = fork(); // clone without: the filter kills here
        if (pid == 0) {
            _exit(0);
        }
        return 13;
    });
    INFO(killed.stderr_text);
    REQUIRE(WIFSIGNALED(killed.status));
    CHECK(WTERMSIG(killed.status) == SIGSYS);
    CHECK(killed.stderr_text.find("qmigd: sandbox: forbidden system call clone (56): killed") !=
          std::string::npos);

    ChildEnd refused = in_child([] {
        if (!sandbox_install(parsed("on,action=errno"))) {
            return 10;
        }
        pid_t pid = fork();
        if (pid == 0) {
            _exit(0);
        }
        if (pid != -1 || errno != EPERM) {
            return 11;
        }
        // A call no role needs at all: refused the same way.
        if (setpriority(PRIO_PROCESS, 0, 5) != -1 || errno != EPERM) {
            return 12;
        }
        // ioctl and prctl: what the daemon asks of them, and nothing else.
        int n = 0;
        if (ioctl(STDERR_FILENO, FIONBIO, &n) != 0 || prctl(PR_SET_NAME, "sbx", 0, 0, 0) != 0) {
            return 13;
        }
        struct winsize ws {};
        if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) != -1 || errno != EPERM) {
            return 14;
        }
        if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) != -1 || errno != EPERM) {
            return 15;
        }
        return 0;
    });
    INFO(refused.stderr_text);
    REQUIRE(WIFEXITED(refused.status));
    CHECK(WEXITSTATUS(refused.status) == 0);
}

TEST_CASE("the allow-list: signals to itself only, sockets of the roles' families only")
{
    if (kSanitized) {
        WARN("skipped under a sanitizer: its runtime's calls are not the daemon's");
        return;
    }
    ChildEnd end = in_child([] {
        pid_t parent = getppid();
        if (!sandbox_install(parsed("on,action=errno"))) {
            return 10;
        }
        // Itself: kill and tgkill (raise(), pthread_kill()) work.
        if (kill(getpid(), 0) != 0 || syscall(SYS_tgkill, getpid(), gettid(), 0) != 0) {
            return 11;
        }
        // Anyone else, every process, a thread named without its process: no
        // (SIGCONT: harmless if the filter let it through). Signal 0 sends
        // nothing and tells whether a pid lives: yes.
        if (kill(parent, SIGCONT) != -1 || errno != EPERM || kill(-1, SIGCONT) != -1 ||
            errno != EPERM || kill(parent, 0) != 0) {
            return 12;
        }
        if (syscall(SYS_tgkill, parent, parent, SIGCONT) != -1 || errno != EPERM ||
            syscall(SYS_tkill, gettid(), 0) != -1 || errno != EPERM) {
            return 13;
        }
        for (int family : {AF_UNIX, AF_INET, AF_INET6}) {
            for (int type : {int(SOCK_STREAM), SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC}) {
                int fd = socket(family, type, 0);
                if (fd < 0) {
                    return 14;
                }
                close(fd);
            }
        }
        // Raw IP (any traffic, forged or read, as root) and other types: no.
        if (socket(AF_INET, SOCK_RAW, IPPROTO_ICMP) != -1 || errno != EPERM ||
            socket(AF_INET6, SOCK_RAW | SOCK_CLOEXEC, IPPROTO_ICMPV6) != -1 || errno != EPERM ||
            socket(AF_UNIX, SOCK_SEQPACKET, 0) != -1 || errno != EPERM ||
            socket(AF_INET, SOCK_PACKET, 0) != -1 || errno != EPERM) {
            return 18;
        }
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
            return 15;
        }
        close(sv[0]);
        close(sv[1]);
        // getaddrinfo()'s probe fails as on a kernel without netlink.
        if (socket(AF_NETLINK, SOCK_RAW, 0) != -1 || errno != EAFNOSUPPORT) {
            return 16;
        }
        if (socket(AF_PACKET, SOCK_RAW, 0) != -1 || errno != EPERM) {
            return 17;
        }
        return 0;
    });
    INFO(end.stderr_text);
    REQUIRE(WIFEXITED(end.status));
    CHECK(WEXITSTATUS(end.status) == 0);

    ChildEnd killed = in_child([] {
        pid_t parent = getppid();
        if (!sandbox_install(parsed("on"))) {
            return 10;
        }
        kill(parent, SIGCONT);
        return 11;
    });
    INFO(killed.stderr_text);
    REQUIRE(WIFSIGNALED(killed.status));
    CHECK(killed.stderr_text.find("forbidden system call kill (62): killed") != std::string::npos);
}

TEST_CASE("spawn=allow: the deny-list lets a command start and refuses QEMU's sets")
{
    if (kSanitized) {
        WARN("skipped under a sanitizer: its runtime's calls are not the daemon's");
        return;
    }
    ChildEnd end = in_child([] {
        if (!sandbox_install(parsed("on,spawn=allow,action=errno")) || sandbox_denies_spawn()) {
            return 10;
        }
        pid_t pid = fork();
        if (pid == 0) {
            execl("/bin/true", "true", nullptr);
            _exit(127);
        }
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
            WEXITSTATUS(status) != 0) {
            return 11;
        }
        // resourcecontrol and elevateprivileges, as QEMU's sandbox
        if (setpriority(PRIO_PROCESS, 0, 5) != -1 || errno != EPERM) {
            return 12;
        }
        if (setuid(0) != -1 || errno != EPERM) {
            return 13;
        }
        // A command is signalled by its group, but nobody signals everyone,
        // and nobody reads every interface's packets.
        if (kill(-1, 0) != -1 || errno != EPERM || socket(AF_PACKET, SOCK_RAW, 0) != -1 ||
            errno != EPERM) {
            return 14;
        }
        return 0;
    });
    INFO(end.stderr_text);
    REQUIRE(WIFEXITED(end.status));
    CHECK(WEXITSTATUS(end.status) == 0);
}
