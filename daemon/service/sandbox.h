// Confining the daemon once it has opened what it needs at start: the
// spirit of QEMU's `-sandbox on,obsolete=deny,elevateprivileges=deny,
// spawn=deny,resourcecontrol=deny` and `-run-with user=,chroot=`.
//
//   --sandbox on[,spawn=deny|allow][,action=kill|errno]
//
// spawn=deny (the default): a seccomp allow-list of the calls qmigd's two
// roles make (kSandboxAllowed in sandbox.cpp; ioctl and prctl only with the
// arguments in kSandboxAllowedArgs); threads only (clone with
// CLONE_THREAD), no fork, no execve; signals to itself only (kill and
// tgkill with its own pid; kill's signal 0, which sends nothing, to any); sockets of the families in
// kSandboxSocketFamilies only (unix, IPv4, IPv6; netlink fails with
// EAFNOSUPPORT). exec: migrations are refused in words
// before anything is tried.
// spawn=allow: exec: commands inherit the filter, and no allow-list can say
// what an arbitrary command needs; so, as QEMU's sandbox, a deny-list:
// obsolete calls, privilege changes, resource control and what no
// migration daemon has business with (mount, ptrace, modules, kexec, bpf,
// namespaces, keyrings, clocks, reboot...), kill(-1) and packet sockets.
// action=kill (the default): a forbidden call logs one line naming it and
// the process dies of SIGSYS, as QEMU's; errno: it fails with EPERM and the
// daemon goes on (the operation that needed it fails with that error).
//
// Everything here is process-wide: install once, from the loop thread,
// after the files and sockets of the start are open.
#pragma once

#include <string>

#include "protocol/error.h"

namespace qmigd {

struct SandboxOptions {
    bool on = false;
    bool spawn = false; // exec: commands may be started
    bool kill = true;   // a forbidden call kills; false: it fails with EPERM
};

// "on", "off", "on,spawn=allow,action=errno"... QEMU's words where it has them.
Status sandbox_parse(const std::string &text, SandboxOptions *out);

// Sets no_new_privs and loads the filter into every thread (TSYNC).
Status sandbox_install(const SandboxOptions &o);

// True once a sandbox that denies spawning is installed: exec: is refused.
bool sandbox_denies_spawn();

// --chroot DIR, then --runas USER (its groups, gid, uid; HOME untouched):
// after the start's files and sockets are open, before the sandbox.
// Either may be empty.
Status drop_privileges(const std::string &chroot_dir, const std::string &user);

// A directory the daemon writes after the drop to --runas USER (a
// parking destination's --ram-dir): a missing one is created (0700) and
// given to USER, an existing one must be writable by USER (its owner,
// primary or supplementary group, or everyone; ACLs are not read), else
// the start fails, not the first park. Nothing to do for an empty user.
Status dir_for_user(const std::string &dir, const std::string &user);

} // namespace qmigd
