#!/usr/bin/env python3
"""qmigd confined (--sandbox, --runas, --chroot): the filter is in the
kernel for every thread, confined daemons migrate with QEMU 10 and with
each other byte for byte, exec: is refused in words under the allow-list
and runs under spawn=allow with its commands confined as configured (a
forbidden call kills them, or fails with EPERM), a daemon run as another
user in a chroot serves a migration and parks a VM, and bad options fail
at start. (The allow-list's own kill and EPERM, on a forbidden call of
the daemon itself, are in the unit tests: test_sandbox.cpp.)"""
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request

from itest import test, main, check, skip
from fixtures import images, MiB, NotifySocket
from runner import (proc_status, free_port, Peer, QMIGD, migrate, wait_status, files_equal,
                    unique_name, remove, stop_all)
from qmp import QMPError
from waiting import wait_until, wait_text, wait_file

SIZE = 32 * MiB


def thread_seccomp_modes(pid):
    return {proc_status(pid, tid)["Seccomp"] for tid in os.listdir(f"/proc/{pid}/task")}


@test
def test_confined_daemons_migrate_with_qemu_and_each_other():
    """Every thread filtered (Seccomp 2, NoNewPrivs 1) in both roles; the
    three pairings with QEMU 10 complete with identical images."""
    for src_kind, dst_kind in (("qemu", "qmigd"), ("qmigd", "qemu"), ("qmigd", "qmigd")):
        with images(SIZE, "mixed") as imgs:
            (name, src_img, dst_img, size), = imgs
            sb = ["--sandbox", "on"]
            src = Peer(src_kind, "source", [(name, src_img, size)], "sbx-src",
                       sb if src_kind == "qmigd" else None)
            dst = Peer(dst_kind, "dest", [(name, dst_img, size)], "sbx-dst",
                       sb if dst_kind == "qmigd" else None)
            try:
                migrate(src, dst, multifd=True, channels=4, timeout=60)
                check(files_equal(src_img, dst_img), f"{src_kind} -> {dst_kind}: images differ")
                for p in (src, dst):
                    if p.kind == "qmigd":
                        st = proc_status(p.proc.pid)
                        check(st["Seccomp"] == "2" and st["NoNewPrivs"] == "1", st)
                        modes = thread_seccomp_modes(p.proc.pid)
                        check(modes == {"2"}, f"threads' seccomp modes {modes}")
                        check("forbidden system call" not in p.log_text(), p.log_text())
            finally:
                stop_all(src, dst)


@test
def test_exec_refused_under_the_allow_list():
    """migrate exec: and migrate-incoming exec: fail in words; the daemon
    still serves and migrates over TCP afterwards."""
    with images(SIZE, "mixed") as imgs:
        (name, src_img, dst_img, size), = imgs
        src = Peer("qmigd", "source", [(name, src_img, size)], "sbx-x-src", ["--sandbox", "on"])
        dst = Peer("qmigd", "dest", [(name, dst_img, size)], "sbx-x-dst", ["--sandbox", "on"])
        try:
            for peer, cmd, uri in ((src, "migrate", "exec:cat > /dev/null"),
                                   (dst, "migrate-incoming", "exec:cat /dev/null")):
                desc = ""
                try:
                    peer.qmp.cmd(cmd, uri=uri)
                    if peer is src:
                        desc = wait_status(src, ("failed",), 60).get("error-desc", "")
                except QMPError as e:
                    desc = str(e)
                check("the sandbox denies starting commands" in desc, desc)
            migrate(src, dst, multifd=True, timeout=60)
            check(files_equal(src_img, dst_img), "images differ")
        finally:
            stop_all(src, dst)


def exec_with_command(action, command, failing=False):
    """A spawn=allow source migrating to exec:COMMAND; returns its log and
    status. A `failing` command's end (its exit status) is in the log."""
    with images(16 * MiB, "mixed") as imgs:  # more than a pipe holds
        (name, src_img, _, size), = imgs
        src = Peer("qmigd", "source", [(name, src_img, size)], "sbx-spawn",
                   ["--sandbox", f"on,spawn=allow,action={action}"])
        try:
            src.qmp.cmd("migrate", uri=f"exec:{command}")
            info = wait_status(src, ("completed", "failed"), 60, fail_on=())
            check(src.proc.poll() is None, "the daemon died")
            if failing:  # logged as it is reaped, after what it said itself
                wait_text(src.log_text, f"{command}' ended with")
            return src.log_text(), info
        finally:
            src.stop()


@test
def test_spawn_allowed_commands_are_confined_as_configured():
    """spawn=allow: an exec: migration saved and restored through gzip
    between two confined daemons is identical; its commands inherit the
    deny-list: a denied call (getpriority, QEMU's resourcecontrol set) kills
    the command with action=kill and fails with EPERM with action=errno.
    The daemon lives on either way."""
    with images(SIZE, "mixed") as imgs:
        (name, src_img, dst_img, size), = imgs
        f = f"/dev/shm/{unique_name('sbx-stream')}.gz"
        sb = ["--sandbox", "on,spawn=allow"]
        src = Peer("qmigd", "source", [(name, src_img, size)], "sbx-gz-src", sb)
        dst = Peer("qmigd", "dest", [(name, dst_img, size)], "sbx-gz-dst", sb)
        try:
            src.qmp.cmd("migrate", uri=f"exec:gzip -1 > {f}")
            wait_status(src, ("completed",), 60)
            dst.qmp.cmd("migrate-incoming", uri=f"exec:gzip -dc < {f}")
            wait_status(dst, ("completed",), 60)
            check(files_equal(src_img, dst_img), "images differ")
        finally:
            try:
                stop_all(src, dst)
            finally:
                if os.path.exists(f):
                    os.unlink(f)
    log, info = exec_with_command("kill", "nice -n 5 cat > /dev/null", failing=True)
    check(info["status"] == "failed", info)
    # nice died of SIGSYS: its shell says so and exits 128 + 31
    check("Bad system call" in log and "ended with exit status 159" in log, log)
    log, info = exec_with_command("errno", "nice -n 5 cat > /dev/null", failing=True)
    # getpriority is refused: nice says so and gives up, the migration fails
    check("nice: cannot get niceness: Operation not permitted" in log, log)
    check(info["status"] == "failed", info)
    log, info = exec_with_command("errno", "cat > /dev/null")
    check(info["status"] == "completed", info)


def park_as_nobody(imgs, park, tag, extra=(), before=None):
    """Parks imgs' one block into a --runas nobody destination's --ram-dir
    park; checks the image and that it is nobody's."""
    (name, src_img, _, size), = imgs
    src = Peer("qmigd", "source", [(name, src_img, size)], f"{tag}-src")
    dst = Peer("qmigd", "dest", [], f"{tag}-dst", ["--ram-dir", park, "--runas", "nobody"] + list(extra))
    try:
        if before:
            before()
        migrate(src, dst, multifd=True, timeout=60)
        parked = os.path.join(park, "00-mem.img")
        check(files_equal(src_img, parked), "parked image differs")
        check(os.stat(parked).st_uid == pwd.getpwnam("nobody").pw_uid, "not nobody's")
    finally:
        stop_all(src, dst)


@test
def test_runas_and_chroot():
    """--runas nobody --chroot EMPTY: the destination drops to nobody in an
    empty root after opening its image and sockets, and a migration into it
    completes identical; the service manager's socket (in a directory of
    the test's, out of the new root's reach and nobody's) still gets
    READY=1 and the watchdog's pings, and /metrics still reads the
    process's memory and threads; a parking destination (--ram-dir owned
    by nobody) parks as nobody, its files nobody's."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        skip("no user 'nobody' on this host", machine=True)
    root = tempfile.mkdtemp(prefix="qmigd-chroot-")
    park = tempfile.mkdtemp(prefix="qmigd-park-", dir="/dev/shm")
    own = tempfile.mkdtemp(prefix="qmigd-notify-")  # 0700, root's
    notify = NotifySocket(dir=own)
    os.chown(park, nobody.pw_uid, nobody.pw_gid)
    try:
        with images(SIZE, "mixed") as imgs:
            (name, src_img, dst_img, size), = imgs
            src = Peer("qmigd", "source", [(name, src_img, size)], "sbx-ru-src")
            port = free_port()
            dst = Peer("qmigd", "dest", [(name, dst_img, size)], "sbx-ru-dst",
                       ["--runas", "nobody", "--chroot", root, "--metrics", f"127.0.0.1:{port}"],
                       env=notify.env(watchdog_usec=200000))
            try:
                notify.wait_for("READY=1", timeout=60)
                wait_until("3 watchdog pings",
                           lambda: sum("WATCHDOG=1" in m for m in notify.read(0.05)) >= 3,
                           seen=notify.read)
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                    text = r.read().decode()
                check(re.search(r"^qmigd_process_resident_memory_bytes [1-9]", text, re.M)
                      and re.search(r"^qmigd_process_threads [1-9]", text, re.M), text)
                st = proc_status(dst.proc.pid)
                check(st["Uid"].split()[:3] == [str(nobody.pw_uid)] * 3, st["Uid"])
                check(os.readlink(f"/proc/{dst.proc.pid}/root") == root,
                      os.readlink(f"/proc/{dst.proc.pid}/root"))
                migrate(src, dst, multifd=True, timeout=60)
                check(files_equal(src_img, dst_img), "images differ")
            finally:
                stop_all(src, dst)
            park_as_nobody(imgs, park, "sbx-rp", ["--sandbox", "on"])
    finally:
        notify.close()
        shutil.rmtree(own, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(park, ignore_errors=True)


@test
def test_bad_options_fail_at_start():
    cases = [(["--sandbox", "yes"], "--sandbox: 'yes' is not on or off"),
             (["--sandbox", "on,spawn=maybe"], "--sandbox: unknown option 'spawn=maybe'"),
             (["--runas", "no-such-user-qmigd"], "--runas: no user 'no-such-user-qmigd'"),
             (["--chroot", "/nonexistent/qmigd"], "--chroot /nonexistent/qmigd: No such file")]
    with images(MiB, "zero") as imgs:
        (name, _, dst_img, size), = imgs
        for extra, want in cases:
            qmp = f"/tmp/{unique_name('sbx-bad')}.qmp"
            r = subprocess.run([QMIGD, "dest", "--qmp", qmp, "--ram", f"{name}={dst_img},size={size}"] + extra,
                               capture_output=True, text=True, timeout=30)
            check(r.returncode == 1 and want in r.stderr, (extra, r.returncode, r.stderr))
            check(not os.path.exists(qmp), f"{qmp} left behind")


@test
def test_incoming_exec_at_start_is_confined():
    """--incoming exec: given at start: refused in words under the
    allow-list (spawn=deny), as migrate-incoming exec: is; with spawn=allow
    its command starts after the filter and the uid drop, so it runs
    confined (Seccomp 2) and as the --runas user."""
    with images(MiB, "zero") as imgs:
        (name, _, dst_img, size), = imgs
        qmp = f"/tmp/{unique_name('sbx-inexec')}.qmp"
        mark = f"/tmp/{unique_name('sbx-inexec')}.ran"
        cmd = f"exec:touch {mark}; cat /dev/null"
        r = subprocess.run([QMIGD, "dest", "--qmp", qmp, "--ram", f"{name}={dst_img},size={size}",
                            "--sandbox", "on", "--incoming", cmd],
                           capture_output=True, text=True, timeout=60)
        ran = os.path.exists(mark)
        remove(mark)
        check(r.returncode == 1 and "the sandbox denies starting commands" in r.stderr,
              (r.returncode, r.stderr))
        check(not ran, "the command ran before the filter")
        out = f"/tmp/{unique_name('sbx-inexec')}.status"
        try:
            nobody = pwd.getpwnam("nobody")
        except KeyError:
            skip("no user 'nobody' on this host", machine=True)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        d = Peer("qmigd", "dest", [(name, dst_img, size)], "sbx-inexec",
                 ["--sandbox", "on,spawn=allow", "--runas", "nobody", "--incoming",
                  f"exec:cat /proc/self/status > {out}; sleep 30"])
        try:
            wait_file(out, nonempty=True)  # one write: cat's of a few KiB
            status = dict(l.split(":\t", 1) for l in open(out).read().splitlines() if ":\t" in l)
            check(status.get("Seccomp") == "2", f"the command's Seccomp: {status.get('Seccomp')}")
            check(status["Uid"].split()[0] == str(nobody.pw_uid), status["Uid"])
        finally:
            d.stop()
            remove(out)


@test
def test_runas_ram_dir_is_the_users():
    """--runas nobody with a --ram-dir that does not exist yet: created
    for nobody, and a park into it completes with nobody's files; an
    existing directory nobody cannot write fails the start in words, not
    the first park."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        skip("no user 'nobody' on this host", machine=True)
    top = tempfile.mkdtemp(prefix="qmigd-runas-", dir="/dev/shm")
    os.chmod(top, 0o755)
    park = os.path.join(top, "vm")
    try:
        with images(SIZE, "mixed") as imgs:
            def created_for_nobody():
                st = os.stat(park)
                check(st.st_uid == nobody.pw_uid and st.st_mode & 0o777 == 0o700,
                      f"{park}: uid {st.st_uid}, mode {st.st_mode:o}")
            park_as_nobody(imgs, park, "sbx-rd", before=created_for_nobody)
        shutil.rmtree(park)
        os.mkdir(park, 0o700)  # root's
        qmp = f"/tmp/{unique_name('sbx-rd-bad')}.qmp"
        r = subprocess.run([QMIGD, "dest", "--qmp", qmp, "--ram-dir", park, "--runas", "nobody"],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode == 1 and f"'{park}' is not writable by nobody" in r.stderr,
              (r.returncode, r.stderr))
        check(not os.path.exists(qmp), f"{qmp} left behind")
    finally:
        shutil.rmtree(top, ignore_errors=True)


# The --runas user's racer: once the daemon's new HOME/vm appears, it swaps
# in a symlink to TARGET (a root file) for what the daemon does next. It
# spins to catch the window; its minute only guards against a daemon that
# never makes the directory.
RACER = """
import os, sys, time
home, target = sys.argv[1:]
end = time.monotonic() + 60
while time.monotonic() < end:
    try:
        os.rename(home + "/vm", home + "/old")
    except OSError:
        continue
    os.symlink(target, home + "/vm")
    os.rmdir(home + "/old")
    break
"""


@test
def test_runas_ram_dir_cannot_be_swapped_for_a_link():
    """--runas nobody --ram-dir HOME/vm with HOME nobody's: nobody swaps a
    symlink to a root file in for the directory the daemon just made (strace
    holds the daemon 300 ms after its mkdir to open the window); the root
    file stays root's and the start fails in words, as the daemon changes
    the directory only through a descriptor opened without following links."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        skip("no user 'nobody' on this host", machine=True)
    if not shutil.which("strace"):
        skip("no strace to widen the window")
    top = tempfile.mkdtemp(prefix="qmigd-race-", dir="/tmp")
    os.chmod(top, 0o755)
    home, target = os.path.join(top, "home"), os.path.join(top, "target")
    os.mkdir(home, 0o755)
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    with open(target, "w") as f:
        f.write("root's\n")
    racer = subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                              "--clear-groups", sys.executable, "-c", RACER, home, target])
    try:
        # Exits after the check: its --qmp directory does not exist.
        r = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=mkdir,mkdirat", "-e",
                            "inject=mkdir,mkdirat:delay_exit=300000", QMIGD, "dest",
                            "--qmp", os.path.join(top, "none", "q.qmp"),
                            "--ram-dir", os.path.join(home, "vm"), "--runas", "nobody"],
                           capture_output=True, text=True, timeout=30)
        racer.wait(timeout=60)
        st = os.stat(target)
    finally:
        if racer.poll() is None:
            racer.kill()
            racer.wait()
        shutil.rmtree(top, ignore_errors=True)
    check(st.st_uid == 0, f"the root file is now uid {st.st_uid}'s:\n{r.stderr}")
    check(r.returncode == 1 and "changed while being made" in r.stderr, (r.returncode, r.stderr))


if __name__ == "__main__":
    main()
