// The exec: transport: spawning the command, ending its process group.
#include "daemon/io/command_channel.h"
#include "daemon/service/sandbox.h"

#include <cerrno>
#include <chrono>
#include <thread>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

namespace qmigd {

namespace {

// The handle's data: keeps the CommandChild alive until the handle closes.
struct ProcData {
    std::shared_ptr<CommandChild> child;
};

} // namespace

Result<std::shared_ptr<CommandChild>> CommandChild::spawn(uv_loop_t *loop,
                                                          const std::vector<std::string> &argv,
                                                          Direction dir, UniqueFd *fd)
{
    std::string command = fmt::format("{}", fmt::join(argv, " "));
    if (argv.empty()) {
        return Error("exec: needs a command"); // QEMU 10 crashes here
    }
    if (sandbox_denies_spawn()) {
        return Error(fmt::format("cannot run exec:{}: the sandbox denies starting commands "
                                 "(--sandbox on,spawn=allow permits them)",
                                 command));
    }
    bool both = dir == Direction::Both;
    int p[2];
    if ((both ? socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, p) : pipe2(p, O_CLOEXEC)) < 0) {
        return Error(fmt::format("cannot create a pipe for exec:{}: {}", command,
                                 std::strerror(errno)));
    }
    UniqueFd read_end(p[0]), write_end(p[1]);
    UniqueFd devnull(open("/dev/null", O_RDWR | O_CLOEXEC));
    if (!devnull) {
        return Error(fmt::format("cannot open /dev/null: {}", std::strerror(errno)));
    }
    bool to_child = dir == Direction::ToChild;
    // A pipe's read end goes to stdin.
    UniqueFd child_end = std::move(to_child || both ? read_end : write_end);
    UniqueFd ours = std::move(to_child || both ? write_end : read_end);

    uv_stdio_container_t stdio[3];
    stdio[0].flags = UV_INHERIT_FD;
    stdio[0].data.fd = to_child || both ? child_end.get() : devnull.get();
    stdio[1].flags = UV_INHERIT_FD;
    stdio[1].data.fd = to_child ? devnull.get() : child_end.get();
    stdio[2].flags = UV_INHERIT_FD;
    stdio[2].data.fd = STDERR_FILENO;

    std::vector<std::string> copy = argv;
    std::vector<char *> args;
    for (auto &a : copy) {
        args.push_back(a.data());
    }
    args.push_back(nullptr);
    uv_process_options_t opt{};
    opt.file = args[0];
    opt.args = args.data();
    opt.exit_cb = on_exit;
    opt.stdio = stdio;
    opt.stdio_count = 3;
    // setsid(): the command leads a process group of its own, which
    // terminate() can end whole (a shell's children are not the shell).
    opt.flags = UV_PROCESS_DETACHED;

    std::shared_ptr<CommandChild> child(new CommandChild);
    child->command_ = command;
    auto *proc = new uv_process_t;
    proc->data = new ProcData{child};
    int rc = uv_spawn(loop, proc, &opt);
    child_end.reset(); // the child's now, as /dev/null is
    devnull.reset();
    if (rc != 0) {
        // A failed spawn still needs its handle closed.
        uv_close(reinterpret_cast<uv_handle_t *>(proc), [](uv_handle_t *h) {
            delete static_cast<ProcData *>(h->data);
            delete reinterpret_cast<uv_process_t *>(h);
        });
        return Error(fmt::format("cannot run exec:{}: {}", command, uv_strerror(rc)));
    }
    child->pid_ = proc->pid;
    child->pgid_ = proc->pid;
    spdlog::info("exec: started '{}' (pid {})", command, proc->pid);
    *fd = std::move(ours);
    return child;
}

void CommandChild::on_exit(uv_process_t *p, int64_t status, int signal)
{
    auto *data = static_cast<ProcData *>(p->data);
    CommandChild &self = *data->child;
    self.pid_ = 0;
    if (self.terminating_) {
        self.signal_group(SIGKILL); // whatever of it outlived the shell
    }
    if (status != 0 || signal != 0) {
        spdlog::warn("exec: '{}' ended with {} {}", self.command_,
                     signal ? "signal" : "exit status", signal ? signal : status);
    }
    uv_close(reinterpret_cast<uv_handle_t *>(p), [](uv_handle_t *h) {
        delete static_cast<ProcData *>(h->data);
        delete reinterpret_cast<uv_process_t *>(h);
    });
}

void CommandChild::signal_group(int sig) const
{
    if (pgid_ > 0) {
        ::kill(-pgid_, sig);
    }
}

void CommandChild::terminate()
{
    // Until libuv reaps the child its number, and so its group's, cannot
    // be reused; the only window is between libuv's waitpid() and on_exit()
    // clearing pid_, a few instructions on the loop thread.
    if (pid_.load() <= 0 || terminating_.exchange(true)) {
        return;
    }
    signal_group(SIGTERM);
    // A command that ignores SIGTERM would hold its pipe, and so the
    // migration thread, forever.
    std::thread([self = shared_from_this()] {
        for (int waited = 0; waited < kGraceMs && self->pid_.load() > 0; waited += 50) {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        if (self->pid_.load() > 0) {
            spdlog::warn("exec: '{}' ignored SIGTERM for {} ms: killed", self->command_,
                         kGraceMs);
            self->signal_group(SIGKILL);
        }
    }).detach();
}

void CommandChild::kill_now()
{
    if (pid_.load() > 0) {
        signal_group(SIGTERM);
        signal_group(SIGKILL);
    }
}

} // namespace qmigd
