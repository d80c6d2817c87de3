// qmigd: QEMU-compatible live-migration daemons.
#include <csignal>
#include <cstdio>
#include <cstring>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "daemon/service/journal_log.h"

#include "daemon/daemon.h"
#include "daemon/tools/guest.h"
#include "daemon/tools/limits.h"

using namespace qmigd;

namespace {

void add_common(CLI::App *cmd, DaemonOptions &o, std::string &uuid, std::string &level,
                std::string &page_path)
{
    cmd->add_option("--link-timeout", o.link_timeout_ms,
                    "ms without acknowledgement before a migration channel counts as dead "
                    "(default 30000; 0 = as long as the kernel retransmits)");
    cmd->add_option("--page-path", page_path,
                    "auto|file|mapped|fill: how page data moves (default auto: measured; "
                    "fill: a destination's writes by userfaultfd on tmpfs)")
        ->check(CLI::IsMember({"auto", "file", "mapped", "fill"}));
    cmd->add_option("--qmp", o.qmp_path, "QMP monitor unix socket path")->required();
    auto *ram = cmd->add_option("--ram", o.ram_specs,
                                "RAM block: NAME=FILE[,size=BYTES][,dirty=PATH][,addr=GPA] (sizes as "
                                "QEMU's: 256M, 1.5G, 0x10000000)");
    auto *dir = cmd->add_option("--ram-dir", o.ram_dir,
                                "a parked VM's directory: dest parks whatever VM the stream "
                                "carries there, source migrates the VM parked there");
    ram->excludes(dir);
    cmd->add_option("--machine-type", o.machine_type, "machine type name (default: none)");
    cmd->add_option("--object", o.objects,
                    "tls-creds-x509,id=ID,dir=DIR,endpoint=client|server[,verify-peer=on|off] "
                    "or authz-list,id=ID,policy=allow|deny (as QEMU's -object)");
    cmd->add_option("--uuid", uuid, "VM UUID carried by multifd handshakes");
    cmd->add_option("--log-level", level, "trace|debug|info|warn|error|critical|off");
    cmd->add_option("--sandbox", o.sandbox,
                    "on[,spawn=deny|allow][,action=kill|errno] or off (default): a seccomp "
                    "filter once the start's files and sockets are open; the last one given "
                    "counts (a unit's default, overridden by its environment file)")
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    cmd->add_option("--runas", o.runas, "user to run as once the start's files are open");
    cmd->add_option("--chroot", o.chroot_dir, "directory to chroot into (with --runas: first)");
    cmd->add_option("--metrics", o.metrics,
                    "serve /metrics for Prometheus at HOST:PORT (or tcp:HOST:PORT)");
}

const char *const kCommands[] = {"source", "dest", "guest", "limits", "version"};

// CLI11 answers "A subcommand is required" to a mistyped one; say which
// word it did not know and what it knows.
bool known_command(int argc, char **argv)
{
    if (argc < 2 || argv[1][0] == '-') {
        return true;
    }
    for (const char *c : kCommands) {
        if (std::strcmp(argv[1], c) == 0) {
            return true;
        }
    }
    std::fprintf(stderr,
                 "qmigd: unknown command '%s' (commands: source, dest, guest, limits, "
                 "version; qmigd --help)\n",
                 argv[1]);
    return false;
}

} // namespace

int main(int argc, char **argv)
{
    // A peer that goes away must show up as a write error, not kill us.
    std::signal(SIGPIPE, SIG_IGN);
    if (!known_command(argc, argv)) {
        return 2;
    }
    CLI::App app{"qmigd: QEMU-compatible live-migration daemons"};
    app.require_subcommand(1);
    app.set_version_flag("--version", "qmigd version " QMIGD_VERSION);
    auto *version = app.add_subcommand("version", "print qmigd's version");
    DaemonOptions src, dst;
    std::string src_uuid, dst_uuid, src_level = "info", dst_level = "info";
    std::string src_path = "auto", dst_path = "auto";
    auto *source = app.add_subcommand("source", "migration source");
    add_common(source, src, src_uuid, src_level, src_path);
    auto *dest = app.add_subcommand("dest", "migration destination");
    add_common(dest, dst, dst_uuid, dst_level, dst_path);
    dest->add_option("--incoming", dst.incoming,
                     "a migration URI (tcp:, unix:, fd:, exec:, file:) or defer (default)");
    source->add_option("--control", src.control_path,
                       "guest control record (default: first image + .ctl)");
    source->add_option("--working-set", src.working_set.on,
                       "with --ram-dir, on a resume by postcopy: send the pages an earlier "
                       "resume's guest asked for first, and record them (default on)");
    source->add_option("--working-set-window", src.working_set.window_s,
                       "seconds from the destination's RUN during which its page requests "
                       "are recorded (default 2)")
        ->check(CLI::Range(0.0, 3600.0));
    source->add_option("--working-set-pages", src.working_set.max_pages,
                       "pages the record holds at most (default 65536)")
        ->check(CLI::Range(uint64_t(0), kWorkingSetMaxPages));
    source->add_option("--working-set-around", src.working_set.around_pages,
                       "after the recorded pages, the aligned span of this many pages around "
                       "each (default 512: 2 MiB; 0 = none)")
        ->check(CLI::Range(uint64_t(0), uint64_t(1) << 20));
    source->add_option("--local-send-buffer", src.local_send_buffer,
                       "SO_SNDBUF of each channel to a destination on this host, keeping the "
                       "pages in flight in cache (default 131072; 0 = kernel autotuning)");

    GuestOptions g;
    std::string g_level = "info", g_pattern = "random", g_hot = "64M";
    auto *guest = app.add_subcommand("guest", "a workload that dirties guest RAM");
    guest->add_option("--ram", g.ram_specs, "RAM block: NAME=FILE[,dirty=PATH]")->required();
    guest->add_option("--rate", g.rate, "pages written per second")->required();
    guest->add_option("--pattern", g_pattern, "random|sequential|hot")
        ->check(CLI::IsMember({"random", "sequential", "hot"}));
    guest->add_option("--hot-set", g_hot, "bytes of the hot set (pattern hot)");
    guest->add_option("--seed", g.seed, "random seed");
    guest->add_option("--write-bytes", g.write_bytes,
                      "bytes each write changes: 4096 rewrites the page, fewer change that "
                      "many at a random place in it (default 4096)")
        ->check(CLI::Range(8, 4096));
    guest->add_option("--duration", g.duration, "seconds to run (default: until signalled)");
    guest->add_option("--control", g.control_path, "guest control record");
    guest->add_option("--log-level", g_level, "log level");
    std::string limits_dir = "/dev/shm";
    auto *limits = app.add_subcommand("limits", "measure this machine's migration limits (JSON)");
    limits->add_option("--dir", limits_dir, "a directory on the guest RAM's file system")
        ->check(CLI::ExistingDirectory);
    unsigned limits_idle = 8;
    limits->add_option("--idle", limits_idle,
                       "seconds memory sits unused before the idle fault pass; 0 skips it "
                       "(default 8)")
        ->check(CLI::Range(0, 600));
    uint64_t limits_fault_bytes = 0;
    limits->add_option("--fault-bytes", limits_fault_bytes,
                       "only fault this many bytes of fresh memory in --dir from one thread "
                       "per core and report its time and CPU (what a destination receiving "
                       "that much data pays to allocate it)")
        ->check(CLI::Range(uint64_t(1), uint64_t(1) << 40));
    CLI11_PARSE(app, argc, argv);

    if (version->parsed()) {
        std::printf("qmigd version %s\n", QMIGD_VERSION);
        return 0;
    }
    if (limits->parsed()) {
        nlohmann::json j = limits_fault_bytes ? measure_fault_scale(limits_dir, limits_fault_bytes)
                                              : measure_limits(limits_dir, limits_idle);
        std::printf("%s\n", j.dump(2).c_str());
        return 0;
    }

    if (guest->parsed()) {
        g.pattern = g_pattern == "hot" ? GuestPattern::Hot
                    : g_pattern == "sequential" ? GuestPattern::Sequential
                                                : GuestPattern::Random;
        if (!parse_size(g_hot, &g.hot_set)) {
            std::fprintf(stderr, "qmigd: bad --hot-set '%s'\n", g_hot.c_str());
            return 2;
        }
        spdlog::set_level(spdlog::level::from_str(g_level));
        Status st = run_guest(g);
        if (!st) {
            spdlog::critical("{}", st.error().message());
            return 1;
        }
        return 0;
    }
    bool is_source = source->parsed();
    DaemonOptions &opts = is_source ? src : dst;
    opts.role = is_source ? Role::Source : Role::Destination;
    const std::string &uuid = is_source ? src_uuid : dst_uuid;
    const std::string &level = is_source ? src_level : dst_level;
    page_path_mode_parse(is_source ? src_path : dst_path, &opts.page_path);

    auto logger = spdlog::stderr_color_mt("qmigd");
    spdlog::set_default_logger(logger);
    set_log_pattern(stderr_is_journal());
    auto lvl = spdlog::level::from_str(level);
    if (lvl == spdlog::level::off && level != "off") {
        spdlog::critical("unknown --log-level '{}'", level); // through the escaping sink
        return 2;
    }
    spdlog::set_level(lvl);
    if (!uuid.empty() && !uuid_parse(uuid, &opts.uuid)) {
        spdlog::critical("bad --uuid '{}'", uuid);
        return 2;
    }
    Daemon daemon(opts);
    Status st = daemon.run();
    if (!st) {
        spdlog::critical("{}", st.error().message());
        return 1;
    }
    return 0;
}
