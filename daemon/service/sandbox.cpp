#include "daemon/service/sandbox.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <grp.h>
#include <optional>
#include <pwd.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <termios.h>
#include <unistd.h>

#include <seccomp.h>
#include <spdlog/spdlog.h>

namespace qmigd {

namespace {

// What the daemon's roles call, found by tracing every integration test
// (strace -f -c) and grouped by what needs them. clone is allowed for
// threads only (below); clone3 answers ENOSYS, so that glibc falls back
// to clone, whose flags a filter can read.
const char *const kSandboxAllowed[] = {
    // memory: RAM images, allocators, page caches
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "mlock", "munlock",
    "membarrier", "memfd_create",
    // files: RAM images, parked VMs, file: and mapped-ram, certificates, /proc/self
    "openat", "open", "close", "close_range", "read", "write", "pread64", "pwrite64", "readv",
    "writev", "preadv", "pwritev", "preadv2", "pwritev2", "lseek", "fstat", "newfstatat",
    "stat", "lstat", "statx", "fstatfs", "statfs", "ftruncate", "fallocate", "fsync",
    "fdatasync", "sync_file_range", "fadvise64", "readahead", "rename", "renameat",
    "renameat2", "unlink", "unlinkat", "mkdir", "mkdirat", "rmdir", "getdents64", "access",
    "faccessat", "faccessat2", "readlink", "readlinkat", "fchmod", "fchmodat", "umask",
    "getcwd", "chdir", "fchdir", "dup", "dup2", "dup3", "fcntl", "flock",
    "copy_file_range", "sendfile", "splice", "tee", "vmsplice", "pipe", "pipe2",
    // sockets: channels, QMP, /metrics, service notifications
    "socket", "socketpair", "bind", "listen", "accept", "accept4", "connect", "shutdown",
    "getsockname", "getpeername", "setsockopt", "getsockopt", "sendto", "recvfrom", "sendmsg",
    "recvmsg", "sendmmsg", "recvmmsg",
    // waiting: libuv, threads, timers
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2",
    "poll", "ppoll", "select", "pselect6", "eventfd", "eventfd2", "futex", "futex_waitv",
    "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday", "time",
    "timerfd_create", "timerfd_settime", "timerfd_gettime", "sched_yield",
    "sched_getaffinity", "set_robust_list", "get_robust_list", "rseq", "set_tid_address",
    // signals
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigtimedwait", "sigaltstack",
    "signalfd", "signalfd4", "kill", "tgkill", "tkill", "restart_syscall",
    // process: threads, exits, who we are, limits the daemon reads
    "exit", "exit_group", "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid",
    "getegid", "getgroups", "getresuid", "getresgid", "arch_prctl", "prlimit64",
    "getrlimit", "getrusage", "times", "sysinfo", "uname", "getrandom", "getcpu",
    "wait4", "waitid",
};

// Calls allowed only with these first or second arguments: ioctl's
// requests (libuv's non-blocking and close-on-exec switches, a byte count,
// the terminal check of the log's colours) and prctl's options (thread
// names; reading the capability bounding set, which systemd's NSS modules
// do while a tcp: host name is resolved). Everything else they can do
// stays forbidden.
struct ArgRule {
    const char *name;
    unsigned arg;
    unsigned long value;
};
const ArgRule kSandboxAllowedArgs[] = {
    {"ioctl", 1, FIONBIO}, {"ioctl", 1, FIOCLEX}, {"ioctl", 1, FIONCLEX},
    {"ioctl", 1, FIONREAD}, {"ioctl", 1, TCGETS},
    {"prctl", 0, PR_SET_NAME}, {"prctl", 0, PR_GET_NAME}, {"prctl", 0, PR_CAPBSET_READ},
};

// spawn=allow: QEMU's sets (obsolete, elevateprivileges, resourcecontrol)
// and the rest no migration daemon has business with.
const char *const kSandboxDenied[] = {
    // obsolete
    "readdir", "_sysctl", "bdflush", "create_module", "get_kernel_syms", "query_module",
    "sgetmask", "ssetmask", "sysfs", "uselib", "ustat", "vm86", "vm86old",
    // elevateprivileges
    // (not setsid: an exec: command leads a process group of its own)
    "setuid", "setgid", "setreuid", "setregid", "setresuid",
    "setresgid", "setfsuid", "setfsgid", "setgroups", "capset",
    // resourcecontrol
    "getpriority", "setpriority", "sched_setparam", "sched_setscheduler", "sched_setattr",
    "sched_setaffinity", "ioprio_set",
    // the host's, not ours
    "mount", "umount2", "pivot_root", "chroot", "swapon", "swapoff", "reboot", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "ptrace",
    "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "unshare", "setns",
    "add_key", "request_key", "keyctl", "acct", "settimeofday", "clock_settime", "adjtimex",
    "clock_adjtime", "iopl", "ioperm", "quotactl", "lookup_dcookie", "open_by_handle_at",
    "name_to_handle_at", "fanotify_init", "personality", "syslog", "vhangup", "nfsservctl",
    "sethostname", "setdomainname", "move_mount", "fsopen", "fsmount", "fspick",
    "open_tree", "mount_setattr",
};

std::atomic<bool> g_denies_spawn{false};

// Names for the SIGSYS handler, resolved before the filter is loaded: the
// handler may call nothing that allocates.
constexpr int kMaxSyscall = 512;
const char *g_names[kMaxSyscall];

void on_sigsys(int, siginfo_t *info, void *)
{
    int nr = info->si_syscall;
    const char *name = nr >= 0 && nr < kMaxSyscall && g_names[nr] ? g_names[nr] : "?";
    char line[160];
    int n = 0;
    auto put = [&](const char *s) {
        while (*s && n < int(sizeof line) - 1) {
            line[n++] = *s++;
        }
    };
    char num[16];
    int d = 0;
    for (unsigned v = nr < 0 ? 0 : unsigned(nr); d == 0 || v; v /= 10) {
        num[d++] = char('0' + v % 10);
    }
    put("qmigd: sandbox: forbidden system call ");
    put(name);
    put(" (");
    while (d) {
        line[n++] = num[--d];
    }
    put("): killed\n");
    (void)!::write(STDERR_FILENO, line, size_t(n));
    // SA_RESETHAND made SIGSYS's action the default again: this kills.
    raise(SIGSYS);
}

// One rule for a call by name, optionally only where one argument compares
// as `cmp` says; a call this architecture lacks is left out.
Status add_rule(scmp_filter_ctx ctx, uint32_t action, const char *name,
                std::optional<scmp_arg_cmp> cmp = std::nullopt)
{
    int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR) {
        return {};
    }
    int rc = seccomp_rule_add_array(ctx, action, nr, cmp ? 1 : 0, cmp ? &*cmp : nullptr);
    if (rc < 0 && rc != -EEXIST) {
        return Error(fmt::format("sandbox: cannot add a rule for {}: {}", name, strerror(-rc)));
    }
    return {};
}

Status build_allow_list(scmp_filter_ctx ctx)
{
    for (const char *name : kSandboxAllowed) {
        QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, name));
    }
    for (const ArgRule &r : kSandboxAllowedArgs) {
        QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, r.name, SCMP_CMP(r.arg, SCMP_CMP_EQ, r.value)));
    }
    // Threads, not processes: fork() is clone without CLONE_THREAD.
    QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, "clone",
                       SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_THREAD, CLONE_THREAD)));
    return add_rule(ctx, SCMP_ACT_ERRNO(ENOSYS), "clone3");
}

Status build_deny_list(scmp_filter_ctx ctx, uint32_t deny)
{
    for (const char *name : kSandboxDenied) {
        QMIGD_TRY(add_rule(ctx, deny, name));
    }
    return {};
}

Status install_sigsys_handler()
{
    for (int nr = 0; nr < kMaxSyscall; nr++) {
        if (!g_names[nr]) {
            g_names[nr] = seccomp_syscall_resolve_num_arch(SCMP_ARCH_NATIVE, nr); // kept
        }
    }
    struct sigaction sa {};
    sa.sa_sigaction = on_sigsys;
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_NODEFER;
    if (sigaction(SIGSYS, &sa, nullptr) < 0) {
        return Error(fmt::format("sandbox: cannot handle SIGSYS: {}", strerror(errno)));
    }
    return {};
}

} // namespace

Status sandbox_parse(const std::string &text, SandboxOptions *out)
{
    SandboxOptions o;
    size_t pos = 0;
    bool first = true;
    while (pos <= text.size()) {
        size_t comma = text.find(',', pos);
        std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos
                                                                        : comma - pos);
        pos = comma == std::string::npos ? text.size() + 1 : comma + 1;
        if (first) {
            first = false;
            if (item != "on" && item != "off") {
                return Error(fmt::format("--sandbox: '{}' is not on or off", item));
            }
            o.on = item == "on";
            continue;
        }
        if (item == "spawn=allow" || item == "spawn=deny") {
            o.spawn = item == "spawn=allow";
        } else if (item == "action=kill" || item == "action=errno") {
            o.kill = item == "action=kill";
        } else {
            return Error(fmt::format("--sandbox: unknown option '{}' (spawn=allow|deny, "
                                     "action=kill|errno)",
                                     item));
        }
    }
    *out = o;
    return {};
}

Status sandbox_install(const SandboxOptions &o)
{
    if (!o.on) {
        return {};
    }
    uint32_t deny = o.kill ? SCMP_ACT_TRAP : SCMP_ACT_ERRNO(EPERM);
    scmp_filter_ctx ctx = seccomp_init(o.spawn ? SCMP_ACT_ALLOW : deny);
    if (!ctx) {
        return Error("sandbox: cannot create a seccomp filter");
    }
    Status st = o.spawn ? build_deny_list(ctx, deny) : build_allow_list(ctx);
    if (st) {
        // Every thread: libuv's and the metrics server's are running.
        seccomp_attr_set(ctx, SCMP_FLTATR_CTL_TSYNC, 1);
        if (o.kill) {
            st = install_sigsys_handler();
        }
    }
    if (st) {
        // libseccomp sets no_new_privs itself (SCMP_FLTATR_CTL_NNP).
        int rc = seccomp_load(ctx);
        if (rc < 0) {
            st = Error(fmt::format("sandbox: cannot load the seccomp filter: {}", strerror(-rc)));
        }
    }
    seccomp_release(ctx);
    QMIGD_TRY(st);
    g_denies_spawn = !o.spawn;
    spdlog::info("sandbox on: {} ({} calls), a forbidden call {}",
                 o.spawn ? "a deny-list, exec: allowed" : "an allow-list, exec: refused",
                 o.spawn ? std::size(kSandboxDenied)
                         : std::size(kSandboxAllowed) + std::size(kSandboxAllowedArgs) + 1,
                 o.kill ? "kills" : "fails with EPERM");
    return {};
}

bool sandbox_denies_spawn()
{
    return g_denies_spawn.load();
}

Status drop_privileges(const std::string &chroot_dir, const std::string &user)
{
    // Looked up before the chroot: the user database is outside it.
    uid_t uid = 0;
    gid_t gid = 0;
    if (!user.empty()) {
        struct passwd *pw = getpwnam(user.c_str());
        if (!pw) {
            return Error(fmt::format("--runas: no user '{}'", user));
        }
        uid = pw->pw_uid;
        gid = pw->pw_gid;
    }
    // The groups while /etc/group is still in reach, then the root.
    if (!user.empty() && initgroups(user.c_str(), gid) < 0) {
        return Error(fmt::format("--runas {}: {}", user, strerror(errno)));
    }
    if (!chroot_dir.empty() && (chroot(chroot_dir.c_str()) < 0 || chdir("/") < 0)) {
        return Error(fmt::format("--chroot {}: {}", chroot_dir, strerror(errno)));
    }
    if (!user.empty()) {
        if (setgid(gid) < 0 || setuid(uid) < 0) {
            return Error(fmt::format("--runas {}: {}", user, strerror(errno)));
        }
        if (setuid(0) == 0) {
            return Error(fmt::format("--runas {}: root could be regained", user));
        }
        spdlog::info("running as {} (uid {}, gid {})", user, uid, gid);
    }
    if (!chroot_dir.empty()) {
        spdlog::info("chroot {}", chroot_dir);
    }
    return {};
}

} // namespace qmigd
