// --sandbox, --runas, --chroot: seccomp filters and dropping privileges (QEMU's -sandbox, -run-with).
#include "daemon/service/sandbox.h"

#include "daemon/io/unique_fd.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <grp.h>
#include <initializer_list>
#include <optional>
#include <pwd.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <vector>
#include <termios.h>
#include <unistd.h>

#include <linux/userfaultfd.h>
#include <seccomp.h>

// libseccomp's SCMP_A0()..SCMP_A5() build a scmp_arg_cmp with one datum
// for SCMP_CMP_EQ and friends; the second stays zero, as it must. Clang
// warns about the member the macro leaves out.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
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
    "bind", "listen", "accept", "accept4", "connect", "shutdown",
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
    "signalfd", "signalfd4", "restart_syscall",
    // process: threads, exits, who we are, limits the daemon reads
    "exit", "exit_group", "getpid", "gettid", "getppid", "getuid", "geteuid", "getgid",
    "getegid", "getgroups", "getresuid", "getresgid", "arch_prctl", "prlimit64",
    "getrlimit", "getrusage", "times", "sysinfo", "uname", "getrandom", "getcpu",
    "wait4", "waitid",
};

// Calls allowed only with these first or second arguments: ioctl's
// requests (libuv's non-blocking and close-on-exec switches, a byte count,
// the terminal check of the log's colours, a destination's fill path:
// ramstate/fill_mapping.h) and prctl's options (thread
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
    {"ioctl", 1, UFFDIO_API}, {"ioctl", 1, UFFDIO_REGISTER}, {"ioctl", 1, UFFDIO_COPY},
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

// The socket families the roles open: unix (QMP, channels, notify), IPv4
// and IPv6 (channels, /metrics, DNS). glibc's getaddrinfo() also opens a
// NETLINK_ROUTE socket to sort a name's addresses (check_pf.c), and takes
// a refusal as "both families present": it gets EAFNOSUPPORT, so that a
// root daemon cannot change routes or addresses through it. Any other
// family (AF_PACKET: every interface's traffic) is forbidden.
const int kSandboxSocketFamilies[] = {AF_UNIX, AF_INET, AF_INET6};
// And their types: streams (channels, QMP, /metrics, DNS over TCP) and
// datagrams (DNS, sd_notify). Not SOCK_RAW, SOCK_SEQPACKET or SOCK_PACKET.
const int kSandboxSocketTypes[] = {SOCK_STREAM, SOCK_DGRAM};

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

// One rule for a call by name, optionally only where its arguments compare
// as `cmps` say (all of them); a call this architecture lacks is left out.
Status add_rule(scmp_filter_ctx ctx, uint32_t action, const char *name,
                std::initializer_list<scmp_arg_cmp> cmps)
{
    int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR) {
        return {};
    }
    int rc = seccomp_rule_add_array(ctx, action, nr, unsigned(cmps.size()),
                                    cmps.size() ? cmps.begin() : nullptr);
    if (rc < 0 && rc != -EEXIST) {
        return Error(fmt::format("sandbox: cannot add a rule for {}: {}", name, strerror(-rc)));
    }
    return {};
}

Status add_rule(scmp_filter_ctx ctx, uint32_t action, const char *name,
                std::optional<scmp_arg_cmp> cmp = std::nullopt)
{
    std::initializer_list<scmp_arg_cmp> none{};
    return cmp ? add_rule(ctx, action, name, {*cmp}) : add_rule(ctx, action, name, none);
}

// socket()'s type with its flags masked off: SOCK_RAW would let a root
// daemon forge and read any IP traffic, SOCK_PACKET any frame.
scmp_arg_cmp socket_type_is(int type)
{
    constexpr uint32_t kTypeMask = ~uint32_t(SOCK_NONBLOCK | SOCK_CLOEXEC);
    return SCMP_A1(SCMP_CMP_MASKED_EQ, kTypeMask, unsigned(type));
}

Status build_allow_list(scmp_filter_ctx ctx)
{
    for (const char *name : kSandboxAllowed) {
        QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, name));
    }
    for (const ArgRule &r : kSandboxAllowedArgs) {
        QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, r.name, SCMP_CMP(r.arg, SCMP_CMP_EQ, r.value)));
    }
    for (int family : kSandboxSocketFamilies) {
        for (int type : kSandboxSocketTypes) {
            QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, "socket",
                               {SCMP_A0(SCMP_CMP_EQ, unsigned(family)), socket_type_is(type)}));
        }
    }
    QMIGD_TRY(add_rule(ctx, SCMP_ACT_ERRNO(EAFNOSUPPORT), "socket",
                       SCMP_A0(SCMP_CMP_EQ, unsigned(AF_NETLINK))));
    QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, "socketpair",
                       {SCMP_A0(SCMP_CMP_EQ, unsigned(AF_UNIX)), socket_type_is(SOCK_STREAM)}));
    // Signals to itself only (raise(), abort(), pthread_kill() are
    // tgkill(getpid(), ...)); tkill names no process and is not needed.
    // No fork after this, so getpid() stays ours. Signal 0 sends nothing:
    // it asks whether a pid lives (a source's guest, GuestControl).
    auto self = static_cast<scmp_datum_t>(getpid());
    QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, "kill", SCMP_A0(SCMP_CMP_EQ, self)));
    QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, "kill", SCMP_A1(SCMP_CMP_EQ, 0)));
    QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, "tgkill", SCMP_A0(SCMP_CMP_EQ, self)));
    // Threads, not processes: fork() is clone without CLONE_THREAD.
    QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, "clone",
                       SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_THREAD, CLONE_THREAD)));
    // A fill mapping's userfaultfd handles user-mode faults only: the kind
    // that catches no fault of the kernel's own.
    QMIGD_TRY(add_rule(ctx, SCMP_ACT_ALLOW, "userfaultfd",
                       SCMP_A0(SCMP_CMP_MASKED_EQ, UFFD_USER_MODE_ONLY, UFFD_USER_MODE_ONLY)));
    return add_rule(ctx, SCMP_ACT_ERRNO(ENOSYS), "clone3");
}

Status build_deny_list(scmp_filter_ctx ctx, uint32_t deny)
{
    for (const char *name : kSandboxDenied) {
        QMIGD_TRY(add_rule(ctx, deny, name));
    }
    // Commands are signalled by process group (kill(-pgid)), so kill stays;
    // but not every process at once, and no packet sockets for anyone.
    QMIGD_TRY(add_rule(ctx, deny, "kill", SCMP_A0(SCMP_CMP_MASKED_EQ, 0xffffffffu, 0xffffffffu)));
    return add_rule(ctx, deny, "socket", SCMP_A0(SCMP_CMP_EQ, unsigned(AF_PACKET)));
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

// Whether the user may create files in a directory with this stat, by
// its mode bits as the kernel reads them (owner, then group, then others).
bool user_may_write(const struct stat &st, const struct passwd &pw)
{
    constexpr mode_t kUser = S_IWUSR | S_IXUSR, kGroup = S_IWGRP | S_IXGRP,
                     kOther = S_IWOTH | S_IXOTH;
    if (pw.pw_uid == 0) {
        return true;
    }
    if (st.st_uid == pw.pw_uid) {
        return (st.st_mode & kUser) == kUser;
    }
    int n = 64;
    std::vector<gid_t> groups(static_cast<size_t>(n));
    if (getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &n) < 0) {
        groups.resize(size_t(n));
        getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &n);
    }
    groups.resize(size_t(std::max(n, 0)));
    if (std::find(groups.begin(), groups.end(), st.st_gid) != groups.end()) {
        return (st.st_mode & kGroup) == kGroup;
    }
    return (st.st_mode & kOther) == kOther;
}

} // namespace

namespace {

// Makes dir and gives it to pw's user. The parent may be that user's (its
// home): it can swap a symlink or a directory of its own in for ours between
// mkdir() and anything done by path, so the directory is opened without
// following a link, checked to be the empty root-owned one we made, and
// changed through its descriptor only.
Status make_dir_for(const std::string &dir, const struct passwd &pw)
{
    if (::mkdir(dir.c_str(), 0700) != 0) {
        return Error(strerror(errno));
    }
    UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) {
        return Error(fmt::format("it changed while being made: {}", strerror(errno)));
    }
    struct stat st;
    bool ours = ::fstat(fd.get(), &st) == 0 && S_ISDIR(st.st_mode) &&
                st.st_uid == ::geteuid() && st.st_nlink == 2;
    if (!ours) {
        return Error("it was replaced while being made");
    }
    if (::fchown(fd.get(), pw.pw_uid, pw.pw_gid) != 0 || ::fchmod(fd.get(), 0700) != 0) {
        return Error(strerror(errno));
    }
    return {};
}

} // namespace

Status dir_for_user(const std::string &dir, const std::string &user)
{
    if (user.empty()) {
        return {};
    }
    struct passwd *pw = getpwnam(user.c_str());
    if (!pw) {
        return Error(fmt::format("--runas: no user '{}'", user));
    }
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 && errno == ENOENT) {
        // Private (the images are the guest's RAM), and the user's.
        if (Status made = make_dir_for(dir, *pw); !made) {
            return Error(fmt::format("'{}' does not exist and cannot be created for {}: {}", dir,
                                     user, made.error().message()));
        }
        spdlog::info("created {} for {} to park the VM in", dir, user);
        return {};
    }
    if (::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && !user_may_write(st, *pw)) {
        return Error(fmt::format("'{}' is not writable by {} (--runas): a park would fail",
                                 dir, user));
    }
    return {}; // other faults are park_dir_check's to report
}

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
                         : std::size(kSandboxAllowed) + std::size(kSandboxAllowedArgs) + 5,
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
