// The file: and fd: transports, and one-channel streams of any kind: opening their descriptor.
#include "daemon/io/file_channel.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

namespace qmigd {

// O_NONBLOCK for the open alone: opening a FIFO blocks until its other
// end opens, and this runs on the loop thread, which serves every monitor
// client. The data path blocks (the flag is cleared again).
Result<UniqueFd> open_file_channel(const MigrationAddress &a, bool for_write)
{
    int flags = for_write ? O_CREAT | O_WRONLY | O_TRUNC : O_RDONLY;
    UniqueFd fd(::open(a.filename.c_str(), flags | O_CLOEXEC | O_NONBLOCK, 0600));
    struct stat st;
    // ENXIO: a FIFO nobody reads, for a writer.
    bool fifo = !fd ? errno == ENXIO : fstat(fd.get(), &st) == 0 && S_ISFIFO(st.st_mode);
    if (fifo) {
        // A pipe can neither be cancelled (no shutdown) nor be waited for
        // without blocking: exec: does it with a process to end.
        return Error(fmt::format("'{}' is a FIFO: file: needs a regular file (exec:cat {} '{}' "
                                 "streams through a pipe)",
                                 a.filename, for_write ? ">" : "<", a.filename));
    }
    if (!fd) {
        return Error(fmt::format("Could not {} '{}': {}", for_write ? "create" : "open",
                                 a.filename, std::strerror(errno)));
    }
    fcntl(fd.get(), F_SETFL, fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
    if (a.offset && ::lseek(fd.get(), off_t(a.offset), SEEK_SET) < 0) {
        return Error(fmt::format("Unable to seek to offset {} whence {} in file: {}",
                                 static_cast<long long>(a.offset), SEEK_SET, std::strerror(errno)));
    }
    return fd;
}

Result<std::vector<UniqueFd>> open_file_channels(const MigrationAddress &a, bool for_write,
                                                 unsigned count, bool direct_io)
{
    int flags = (for_write ? O_WRONLY : O_RDONLY) | O_CLOEXEC | (direct_io ? O_DIRECT : 0);
    std::vector<UniqueFd> fds;
    for (unsigned i = 0; i < count; i++) {
        UniqueFd fd(::open(a.filename.c_str(), flags));
        if (!fd) {
            return Error(fmt::format("Could not open '{}'{}: {}", a.filename,
                                     direct_io ? " with O_DIRECT (direct-io)" : "",
                                     std::strerror(errno)));
        }
        fds.push_back(std::move(fd));
    }
    return fds;
}

Result<UniqueFd> open_stream_channel(const MigrationAddress &a, bool for_write,
                                     const FdSource &fds)
{
    if (a.transport == MigrationAddress::Transport::File) {
        return open_file_channel(a, for_write);
    }
    if (!fds) {
        return Error("File descriptor named '" + a.fdname + "' has not been found");
    }
    auto named = fds(a.fdname);
    QMIGD_TRY(named);
    UniqueFd fd(*named);
    int flags = fcntl(fd.get(), F_GETFL);
    if (flags < 0) {
        return Error(fmt::format("fd:{}: {}", a.fdname, std::strerror(errno)));
    }
    fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    return fd;
}

Result<UniqueFd> open_one_channel(uv_loop_t *loop, const MigrationAddress &a, bool for_write,
                                  bool both_ways, const FdSource &fds,
                                  std::shared_ptr<CommandChild> *child)
{
    if (a.transport != MigrationAddress::Transport::Exec) {
        return open_stream_channel(a, for_write, fds);
    }
    UniqueFd fd;
    auto dir = both_ways   ? CommandChild::Direction::Both
               : for_write ? CommandChild::Direction::ToChild
                           : CommandChild::Direction::FromChild;
    auto spawned = CommandChild::spawn(loop, a.argv, dir, &fd);
    QMIGD_TRY(spawned);
    *child = *spawned;
    return fd;
}

} // namespace qmigd
