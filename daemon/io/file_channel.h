// The file: transport without mapped-ram: the migration stream written to
// or read from a file, sequentially from an offset. One channel only (QEMU
// needs mapped-ram for multifd to a file).
#pragma once

#include <memory>
#include <vector>

#include <uv.h>

#include "daemon/io/command_channel.h"
#include "daemon/io/migration_address.h"
#include "daemon/io/unique_fd.h"
#include "protocol/error.h"

namespace qmigd {

// Opens a.filename as QEMU's file_start_outgoing_migration() does (created
// or truncated, mode 0600) or file_start_incoming_migration() (read only),
// positioned at a.offset; returns a blocking, close-on-exec descriptor.
// QEMU's error texts ("Could not create 'PATH': …", "Could not open 'PATH': …").
Result<UniqueFd> open_file_channel(const MigrationAddress &a, bool for_write);

// mapped-ram with multifd: `count` more descriptors of the same file, one
// per channel (QEMU's file_send_channel_create(): write only, never
// truncating; O_DIRECT with direct_io), or read only for a destination.
Result<std::vector<UniqueFd>> open_file_channels(const MigrationAddress &a, bool for_write,
                                                 unsigned count, bool direct_io);

// The stream of a non-socket URI other than exec: a file: file, or the
// fd:NAME descriptor from `fds` (its owner from now on; made blocking: the
// data path blocks).
Result<UniqueFd> open_stream_channel(const MigrationAddress &a, bool for_write,
                                     const FdSource &fds);

// Our end of any one-channel stream: the above, or for exec: the pipe of
// a command spawned on `loop` (kept in *child; the source writes its
// stdin, the destination reads its stdout; `both_ways`, for TLS: one
// socket that is the command's stdin and stdout).
Result<UniqueFd> open_one_channel(uv_loop_t *loop, const MigrationAddress &a, bool for_write,
                                  bool both_ways, const FdSource &fds,
                                  std::shared_ptr<CommandChild> *child);

} // namespace qmigd
