// IncomingParams: what migrate-incoming was given (capabilities, parameters, TLS, parking).
#pragma once

#include <string>

#include "daemon/tls/tls_creds.h"
#include "protocol/multifd_compress.h"
#include "protocol/qemu_format.h"

namespace qmigd {

struct IncomingParams {
    bool multifd = false;
    unsigned channels = 0;
    Uuid uuid{};
    std::string machine_type = "none";
    unsigned link_timeout_ms = 30000; // dead-link detection, 0 = never
    // mapped-ram (file: only): pages read from their places in the file,
    // by `channels` threads with multifd; O_DIRECT with direct_io.
    bool mapped_ram = false;
    bool direct_io = false;
    // multifd-compression: the method every multifd packet with pages must
    // carry (not used by mapped-ram, whose pages are raw in the file).
    MultiFDCompression compression = MultiFDCompression::None;
    // tls-creds (server endpoint) and tls-authz: every channel (a
    // listener's, fd:'s, exec:'s; file: is refused) is a TLS server,
    // classified by its first decrypted bytes.
    TlsParams tls;
    // Non-empty: park the VM in this directory (daemon/park/parked_vm.h):
    // its RAM blocks are created as the stream announces them.
    std::string park_dir;
    // postcopy-ram: the source may switch to postcopy; the device state
    // then comes in a package before the rest of RAM (protocol/loadvm.h).
    bool postcopy_ram = false;
    // postcopy-preempt: the first connection after the main channel is the
    // preempt channel, where a source sends the pages asked for.
    bool postcopy_preempt = false;
    // x-ignore-shared: the source's blocks are ours, mapped from the same
    // files: checked by address, and no page need come.
    bool ignore_shared = false;
    // switchover-ack: acknowledged as the return path opens (no device of
    // qmigd's holds the switchover).
    bool switchover_ack = false;
};

} // namespace qmigd
