// The exec: transport: the migration stream through a command (`exec:CMD`
// is `/bin/sh -c CMD`; a channels exec address gives the argv itself), as
// QEMU's qio_channel_command_new_spawn() runs it. The source writes the
// child's stdin (its stdout is /dev/null); the destination reads the
// child's stdout (its stdin is /dev/null); stderr is the daemon's. A TLS
// session needs both ways: then the child's stdin and stdout are one
// socket, ours the other end of it (QEMU's O_RDWR command channel). One
// channel only: QEMU allows no multifd over exec.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <sys/types.h>
#include <vector>

#include <uv.h>

#include "daemon/io/unique_fd.h"
#include "protocol/error.h"

namespace qmigd {

class CommandChild : public std::enable_shared_from_this<CommandChild> {
public:
    enum class Direction { ToChild, FromChild, Both };

    // Spawns the command; returns the child and sets *fd to our end of its
    // pipe, or of its socket for Both (blocking, close-on-exec).
    // Loop thread.
    static Result<std::shared_ptr<CommandChild>> spawn(uv_loop_t *loop,
                                                       const std::vector<std::string> &argv,
                                                       Direction dir, UniqueFd *fd);

    // Ends the whole command, for a failed or cancelled migration: SIGTERM
    // to its process group (the shell and whatever it started: `a | b`,
    // `a && b`), SIGKILL to what is left of the group once the shell is
    // reaped, and to all of it if the shell still runs kGrace later (it
    // ignored SIGTERM). A blocked write or read on its pipe then returns.
    // A child that exits by itself is reaped on the loop and its exit
    // logged if it failed. Any thread.
    void terminate();
    // The daemon quits: SIGTERM, then SIGKILL to the group at once, so no
    // part of the command outlives the daemon. Any thread.
    void kill_now();

    static constexpr int kGraceMs = 3000;

private:
    static void on_exit(uv_process_t *p, int64_t status, int signal);
    void signal_group(int sig) const;

    std::string command_; // set at spawn, then read-only
    // Set at spawn (the child leads a process group of its own, with its
    // pid as the group's id), 0 once the loop has reaped it; read by any
    // thread. While it is not 0 the id cannot be reused.
    std::atomic<pid_t> pid_{0};
    pid_t pgid_ = 0; // set at spawn, then read-only
    std::atomic<bool> terminating_{false};
};

} // namespace qmigd
