#!/usr/bin/env python3
"""Migration transports other than tcp: against QEMU 10.

unix:PATH in both roles, with and without multifd, each direction with
QEMU 10; what the destination reports while it listens, the errors of a
missing or too long path, and the socket file's life (a stale file is
replaced; the file goes when the listener closes). exec:COMMAND saving
and restoring through a shell command, each direction with QEMU 10, and
through gzip; multifd over exec: refused. file:PATH[,offset=N] (the plain
stream, no mapped-ram) each direction, and its errors. fd:NAME with
descriptors passed through getfd (SCM_RIGHTS), each direction, and the
getfd/closefd errors. All compared with what QEMU 10 does in the same
situation."""
import os
import time

from itest import test, main, check
from fixtures import run_cell, images, peers, good_run, hand_over_socketpair, MiB
from runner import unique_name, wait_status, remove, files_equal
from runner import sandbox_allow_spawn
from waiting import wait_until, wait_file

# Most of these run exec: commands: under QMIGD_SANDBOX their daemons allow
# spawning (the deny-list; the allow-list refuses exec: in test_sandbox.py).
sandbox_allow_spawn()
from qmp import QMPError

SIZE = 64 * MiB


def sock_path():
    return f"/tmp/{unique_name('mig')}.sock"


for src_kind, dst_kind in [("qmigd", "qmigd"), ("qemu", "qmigd"), ("qmigd", "qemu")]:
    for multifd in (False, True):
        def fn(src_kind=src_kind, dst_kind=dst_kind, multifd=multifd):
            path = sock_path()
            try:
                run_cell(src_kind, dst_kind, SIZE, "mixed", multifd, 4, "multifd",
                         unix_path=path)
            finally:
                remove(path)
        fn.__name__ = f"test_unix_{src_kind}_to_{dst_kind}_{'multifd4' if multifd else 'plain'}"
        test(fn)


def each_dest(fn):
    """Runs fn(peer, path) on a QEMU 10 and a qmigd destination; returns
    {kind: result}."""
    out = {}
    with images(4 * MiB, "zero") as imgs, peers("qemu", "qemu", imgs) as (_, qemu), \
            peers("qmigd", "qmigd", imgs) as (_, ours):
        for kind, peer in (("qemu", qemu), ("qmigd", ours)):
            path = sock_path()
            try:
                out[kind] = fn(peer, path)
            finally:
                remove(path)
    return out


@test
def test_unix_listening_address_as_qemu():
    def listen(peer, path):
        peer.qmp.cmd("migrate-incoming", uri=f"unix:{path}")
        addr = peer.status()["socket-address"]
        hmp = [line for line in peer.qmp.hmp("info migrate").splitlines() if "unix:" in line]
        return (addr, [line.replace(path, "PATH") for line in hmp],
                os.path.exists(path)) if addr[0].get("path") == path else ("wrong path", addr)
    seen = each_dest(listen)
    got = {k: (v[0][0]["type"], v[1], v[2]) for k, v in seen.items()}
    check(got["qmigd"] == got["qemu"], f"listening on unix: {got}")
    check(set(seen["qmigd"][0][0]) == set(seen["qemu"][0][0]),
          f"socket-address members differ: {seen}")


@test
def test_unix_stale_file_replaced_as_qemu():
    def listen_over_file(peer, path):
        with open(path, "w") as f:
            f.write("stale")
        peer.qmp.cmd("migrate-incoming", uri=f"unix:{path}")
        import stat
        return stat.S_ISSOCK(os.stat(path).st_mode)
    seen = each_dest(listen_over_file)
    check(seen == {"qemu": True, "qmigd": True}, f"a stale file at the path: {seen}")


@test
def test_unix_too_long_listen_path_as_qemu():
    def listen_long(peer, _):
        try:
            peer.qmp.cmd("migrate-incoming", uri="unix:/tmp/" + "x" * 120)
            return "accepted"
        except QMPError as e:
            return e.desc
    seen = each_dest(listen_long)
    check(seen["qmigd"] == seen["qemu"], f"too long listen path: {seen}")


def failed_connect(uri):
    """error-desc of a migration to uri, from QEMU 10 and from qmigd."""
    out = {}
    with images(4 * MiB, "zero") as imgs, peers("qemu", "qemu", imgs) as (qemu, _), \
            peers("qmigd", "qmigd", imgs) as (ours, _):
        for kind, peer in (("qemu", qemu), ("qmigd", ours)):
            peer.qmp.cmd("migrate", uri=uri)
            info = wait_status(peer, ("failed",), timeout=60, fail_on=("completed",))
            out[kind] = info.get("error-desc")
    return out


@test
def test_unix_connect_missing_path_as_qemu():
    seen = failed_connect(f"unix:{sock_path()}")
    check(seen["qmigd"] == seen["qemu"] and seen["qemu"], f"missing socket: {seen}")


@test
def test_unix_connect_too_long_path_as_qemu():
    seen = failed_connect("unix:/tmp/" + "y" * 120)
    check(seen["qmigd"] == seen["qemu"] and seen["qemu"], f"too long path: {seen}")


@test
def test_unix_socket_removed_when_done_as_qemu():
    """After a completed migration both destinations have closed their
    listener; whether the socket file is left must match QEMU."""
    left = {}
    for dst_kind in ("qemu", "qmigd"):
        path = sock_path()
        try:
            run_cell("qmigd", dst_kind, 8 * MiB, "mixed", True, 2, "multifd", unix_path=path)
            left[dst_kind] = os.path.exists(path)
        finally:
            remove(path)
    check(left["qmigd"] == left["qemu"], f"socket file left after the migration: {left}")


def save_load(src_kind, dst_kind, save_uri, load_uri, ready, size=32 * MiB):
    """The source saves to save_uri; once `ready` exists the destination
    loads from load_uri; the images must be identical."""
    with images(size, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (src, dst):
        src.set_migration(False, 2, "legacy", 0)
        dst.set_migration(False, 2)
        src.qmp.cmd("migrate", uri=save_uri)
        wait_status(src, ("completed",), timeout=120)
        wait_file(ready)
        dst.qmp.cmd("migrate-incoming", uri=load_uri)
        wait_status(dst, ("completed",), timeout=120)
        check(files_equal(imgs[0][1], imgs[0][2]),
              f"{src_kind} -> {dst_kind} through {save_uri} / {load_uri}: images differ")


def exec_save_load(src_kind, dst_kind, save, load):
    """Through exec:SAVE and exec:LOAD ({f} is a stream file in /dev/shm)."""
    f = f"/dev/shm/{unique_name('stream')}"
    try:
        # Written under another name and renamed when the command ends,
        # so the load never reads a stream still being written.
        save_load(src_kind, dst_kind, "exec:" + save.format(f=f + ".part") + f" && mv {f}.part {f}",
                  "exec:" + load.format(f=f), f)
    finally:
        remove(f, f + ".part")


def file_save_load(src_kind, dst_kind, offset=None):
    f = f"/dev/shm/{unique_name('stream')}"
    opt = f",offset={offset}" if offset else ""
    try:
        save_load(src_kind, dst_kind, f"file:{f}{opt}", f"file:{f}{opt}", f)
    finally:
        remove(f)


@test
def test_file_qemu_saves_qmigd_restores():
    file_save_load("qemu", "qmigd", offset="0x1000")


@test
def test_file_qmigd_saves_qemu_restores():
    file_save_load("qmigd", "qemu", offset="4k")


@test
def test_file_qmigd_to_qmigd():
    file_save_load("qmigd", "qmigd")


def each_pair(fn):
    """Runs fn(src, dst) on a QEMU 10 pair and a qmigd pair; {kind: result}."""
    seen = {}
    with images(4 * MiB, "zero") as imgs, peers("qemu", "qemu", imgs) as (qs, qd), \
            peers("qmigd", "qmigd", imgs) as (ms, md):
        for kind, src, dst in (("qemu", qs, qd), ("qmigd", ms, md)):
            seen[kind] = fn(src, dst)
    return seen


def try_cmd(peer, cmd, **args):
    return try_cmd_fd(peer, cmd, None, **args)


def try_cmd_fd(peer, cmd, fd, **args):
    try:
        peer.qmp.cmd(cmd, fd=fd, **args)
        return "accepted"
    except QMPError as e:
        return e.desc


@test
def test_file_errors_as_qemu():
    missing = f"/tmp/{unique_name('nodir')}/x"

    def errors(src, dst):
        out = [try_cmd(src, "migrate", uri=f"file:{missing}")]
        info = src.status()
        out.append((info.get("status"), info.get("error-desc")))
        out.append(try_cmd(dst, "migrate-incoming", uri=f"file:{missing}"))
        out.append(try_cmd(src, "migrate", uri="file:/tmp/x,offset=1Q"))
        src.set_migration(True, 2)
        out.append(try_cmd(src, "migrate", uri="file:/tmp/x"))
        return out
    seen = each_pair(errors)
    check(seen["qmigd"] == seen["qemu"], f"file: errors: {seen}")


@test
def test_exec_qemu_saves_qmigd_restores():
    exec_save_load("qemu", "qmigd", "cat > {f}", "cat {f}")


@test
def test_exec_qmigd_saves_qemu_restores():
    exec_save_load("qmigd", "qemu", "cat > {f}", "cat {f}")


@test
def test_exec_qmigd_to_qmigd_through_gzip():
    exec_save_load("qmigd", "qmigd", "gzip -1 > {f}", "gzip -dc < {f}")


def fd_migrate(src_kind, dst_kind):
    """Each side gets one end of a socketpair through getfd (as libvirt
    hands QEMU a connected socket), then migrates over fd:mig."""
    with images(32 * MiB, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (src, dst):
        src.set_migration(False, 2, "legacy", 0)
        dst.set_migration(False, 2)
        hand_over_socketpair(src, dst)
        dst.qmp.cmd("migrate-incoming", uri="fd:mig")
        src.qmp.cmd("migrate", uri="fd:mig")
        wait_status(src, ("completed",), timeout=120)
        wait_status(dst, ("completed",), timeout=120)
        check(files_equal(imgs[0][1], imgs[0][2]), f"{src_kind} -> {dst_kind} over fd: differs")


for src_kind, dst_kind in [("qmigd", "qmigd"), ("qemu", "qmigd"), ("qmigd", "qemu")]:
    def fn(src_kind=src_kind, dst_kind=dst_kind):
        fd_migrate(src_kind, dst_kind)
    fn.__name__ = f"test_fd_{src_kind}_to_{dst_kind}"
    test(fn)


@test
def test_getfd_closefd_errors_as_qemu():
    def errors(src, dst):
        out = [try_cmd(src, "getfd", fdname="x")]             # no descriptor sent
        r, w = os.pipe()
        try:
            out.append(try_cmd_fd(src, "getfd", r, fdname="9x"))  # name starts with a digit
            out.append(try_cmd_fd(src, "getfd", w, fdname="a"))
        finally:
            os.close(r)
            os.close(w)
        out.append(try_cmd(src, "closefd", fdname="a"))
        out.append(try_cmd(src, "closefd", fdname="a"))       # already closed
        out.append(try_cmd(src, "migrate", uri="fd:nosuch"))
        out.append(src.status().get("status"))
        out.append(try_cmd(dst, "migrate-incoming", uri="fd:nosuch"))
        return out
    seen = each_pair(errors)
    check(seen["qmigd"] == seen["qemu"], f"getfd/closefd/fd: errors: {seen}")


@test
def test_exec_with_multifd_refused_as_qemu():
    def refused(src, dst):
        src.set_migration(True, 2)
        dst.set_migration(True, 2)
        return [try_cmd(src, "migrate", uri="exec:cat > /dev/null"),
                try_cmd(dst, "migrate-incoming", uri="exec:cat /dev/null")]
    seen = each_pair(refused)
    check(seen["qmigd"] == seen["qemu"], f"exec: with multifd: {seen}")


@test
def test_exec_command_that_fails():
    """A command that exits at once: the source fails with an error-desc,
    as QEMU's does, and migrates again afterwards."""
    with images(32 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        src.set_migration(False, 2, "legacy", 0)
        src.qmp.cmd("migrate", uri="exec:exit 3")
        info = wait_status(src, ("failed",), timeout=30, fail_on=("completed",))
        check(info.get("error-desc"), info)
        good_run(src, imgs, dst)


def command_group(tag):
    """The process group of the exec: command whose text holds `tag`."""
    def found():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if tag.encode() in f.read():
                        with open(f"/proc/{pid}/stat") as st:
                            return int(st.read().rsplit(")", 1)[1].split()[2])
            except OSError:
                pass
        return None
    return wait_until(f"a process running the command tagged {tag}", found, every=0.05,
                      seen=lambda: "none")


def group_members(pgid):
    """Live (not zombie) processes of process group pgid."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as st:
                fields = st.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(pid))
    return out


# A command that never reads or writes its pipe and has a child of its
# own; with ignore_term its shell also ignores SIGTERM.
def stuck_command(tag, ignore_term):
    trap = "trap '' TERM; " if ignore_term else ""
    return f"{trap}sleep 300 & sleep 300; wait; : {tag}"


@test
def test_exec_cancel_and_quit_end_the_whole_command():
    """migrate_cancel and quit end the command's whole process group (its
    shell and the shell's children), also when the shell ignores SIGTERM,
    in both roles, within a few seconds; the daemon goes on after a cancel."""
    for role in ("source", "dest"):
        for ignore_term in (False, True):
            for how in ("cancel", "quit"):
                tag = unique_name(f"exec-{role}-{how}")
                with images(32 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
                    p = s if role == "source" else d
                    p.set_migration(False)
                    uri = "exec:" + stuck_command(tag, ignore_term)
                    p.qmp.cmd("migrate" if role == "source" else "migrate-incoming", uri=uri)
                    pgid = command_group(tag)
                    # The shell and its two sleeps.
                    wait_until(f"the command's group {pgid} to be 3 processes",
                               lambda: len(group_members(pgid)) >= 3, every=0.05,
                               seen=lambda: group_members(pgid))
                    check(len(group_members(pgid)) == 3, group_members(pgid))
                    t0 = time.monotonic()
                    if how == "cancel":
                        p.qmp.cmd("migrate_cancel")
                        wait_status(p, ("cancelled",), timeout=60, fail_on=("completed",))
                    else:
                        p.qmp.execute("quit")
                        p.proc.wait(timeout=60)
                    # A latency test: a shell that ignores SIGTERM gets
                    # SIGKILL 3 s on (CommandChild::kGraceMs); 30 s is that
                    # grace 4 times over and more, and far short of the
                    # 300 s the sleeps would take to end by themselves.
                    wait_until(f"{role} {how} (ignore TERM {ignore_term}) to end group {pgid}",
                               lambda: not group_members(pgid), timeout=30, every=0.05,
                               seen=lambda: group_members(pgid))
                    print(f"  {role} {how} (ignore TERM {ignore_term}): the command's group "
                          f"ended {time.monotonic() - t0:.1f} s after it", flush=True)
                    if how == "cancel":
                        check("return" in p.qmp.execute("query-status"))


@test
def test_file_on_a_fifo_refused_at_once():
    """file: on a FIFO with nobody at its other end: refused at once with a
    clear error, in both roles, while a second monitor client is served
    (opening the FIFO used to block the loop, and so every client)."""
    fifo = f"/tmp/{unique_name('fifo')}"
    os.mkfifo(fifo)
    try:
        with images(8 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
            for p, cmd in ((s, "migrate"), (d, "migrate-incoming")):
                p.set_migration(False)
                # An open that blocks waits for a reader that never comes:
                # the refusal coming at all (or the failure it leads to)
                # is the proof, and the QMP timeout guards the hang.
                try:
                    p.qmp.cmd(cmd, uri=f"file:{fifo}")
                    err = wait_status(p, ("failed",), timeout=60,
                                      fail_on=("completed",)).get("error-desc", "")
                except QMPError as e:
                    err = str(e)
                check("is a FIFO" in err, (cmd, err))
                check("return" in p.qmp.execute("query-status"))
            good_run(s, imgs, d)
    finally:
        os.unlink(fifo)


def main_channel(addr):
    return [{"channel-type": "main", "addr": addr}]


INET = {"transport": "socket", "type": "inet", "host": "h", "port": "2"}
# Argument errors QEMU's QAPI visitor finds before the command runs, and
# the command's own checks of the list; none of them changes any state.
CHANNEL_CASES = [
    {"channels": {}},
    {"channels": [1]},
    {"channels": [{}]},
    {"channels": [{"channel-type": "main"}]},
    {"channels": [{"channel-type": "bogus", "addr": {}}]},
    {"channels": main_channel({})},
    {"channels": main_channel({"transport": "bogus"})},
    {"channels": main_channel({"transport": "socket"})},
    {"channels": main_channel({"transport": "socket", "type": "inet"})},
    {"channels": main_channel(dict(INET, host=1))},
    {"channels": main_channel(dict(INET, port=2))},
    {"channels": main_channel(dict(INET, x=1))},
    {"channels": [{"channel-type": "main", "addr": INET, "y": 1}]},
    {"channels": main_channel(dict(INET, to=70000))},
    {"channels": main_channel(dict(INET, to="x"))},
    {"channels": main_channel(dict(INET, ipv4="yes"))},
    {"channels": main_channel({"transport": "socket", "type": "unix"})},
    {"channels": main_channel({"transport": "socket", "type": "fd"})},
    {"channels": main_channel({"transport": "socket", "type": "vsock"})},
    {"channels": main_channel({"transport": "exec"})},
    {"channels": main_channel({"transport": "exec", "args": "x"})},
    {"channels": main_channel({"transport": "exec", "args": [1]})},
    {"channels": main_channel({"transport": "file"})},
    {"channels": main_channel({"transport": "file", "filename": "/x"})},
    {"channels": main_channel({"transport": "file", "filename": "/x", "offset": "1"})},
    {"channels": main_channel({"transport": "file", "filename": "/x", "offset": 1.5})},
    {"channels": []},
    {"uri": "tcp:h:1", "channels": main_channel(INET)},
    {"channels": main_channel(INET) * 2},
    {"uri": "fd:"},
    {"uri": 1, "channels": 1},
    {"channels": main_channel(INET), "detach": 1},
]


@test
def test_channels_argument_errors_as_qemu():
    def errors(src, dst):
        return ([try_cmd(src, "migrate", **a) for a in CHANNEL_CASES] +
                [try_cmd(dst, "migrate-incoming", **a) for a in CHANNEL_CASES if "detach" not in a])
    seen = each_pair(errors)
    diffs = [(i, q, m) for i, (q, m) in enumerate(zip(seen["qemu"], seen["qmigd"])) if q != m]
    check(not diffs, "channels errors differ (case, QEMU, qmigd):\n" +
          "\n".join(map(str, diffs)))


def settled(peer):
    """query-migrate once no migration is under way: none began, or it ended."""
    last = {}

    def done():
        last["info"] = peer.status()
        return last["info"].get("status") in (None, "failed", "completed", "cancelled")
    wait_until(f"{peer.kind} {peer.role} to have no migration under way", done,
               seen=lambda: last["info"])
    return last["info"]


@test
def test_channels_semantic_errors_as_qemu():
    """Errors after the arguments are read: each on a fresh pair (a QEMU
    destination stays in `setup` after one)."""
    cases = [("migrate", main_channel({"transport": "file", "filename": "/nonexist/x",
                                       "offset": 0})),
             ("migrate", main_channel({"transport": "socket", "type": "fd", "str": "nosuch"})),
             ("migrate-incoming", main_channel({"transport": "socket", "type": "fd",
                                                "str": "nosuch"})),
             ("migrate-incoming", main_channel({"transport": "socket", "type": "unix",
                                                "path": "/nonexist/s"})),
             ("migrate-incoming", main_channel({"transport": "file", "filename": "/nonexist/x",
                                                "offset": 0})),
             # a cpr channel beside the main one: QEMU 10 (not in cpr-transfer
             # mode) ignores it and connects the main one
             ("migrate", main_channel({"transport": "socket", "type": "unix", "path": "/nonexist/m"}) +
              [{"channel-type": "cpr", "addr": {"transport": "socket", "type": "unix",
                                                "path": "/nonexist/c"}}])]
    for cmd, channels in cases:
        def one(src, dst):
            peer = src if cmd == "migrate" else dst
            got = try_cmd(peer, cmd, channels=channels)
            if cmd != "migrate":
                return got, None
            # A migration that began fails on its own time (a connect that
            # fails, from its thread); a refused one has said all it says.
            info = (wait_status(peer, ("failed", "completed", "cancelled"), fail_on=())
                    if got == "accepted" else settled(peer))
            return got, info.get("error-desc")
        seen = each_pair(one)
        check(seen["qmigd"] == seen["qemu"], f"{cmd} {channels}: {seen}")


@test
def test_channels_migrate_both_ways():
    """channels= instead of uri=: a unix socket, qmigd -> QEMU, and an
    exec argv (no shell), QEMU -> qmigd."""
    path = sock_path()
    try:
        with images(32 * MiB, "mixed") as imgs, peers("qmigd", "qemu", imgs) as (src, dst):
            src.set_migration(True, 2, "multifd", 0)
            dst.set_migration(True, 2)
            chan = main_channel({"transport": "socket", "type": "unix", "path": path})
            dst.qmp.cmd("migrate-incoming", channels=chan)
            src.qmp.cmd("migrate", channels=chan)
            wait_status(src, ("completed",), timeout=120)
            wait_status(dst, ("completed",), timeout=120)
            check(files_equal(imgs[0][1], imgs[0][2]), "qmigd -> QEMU over channels differs")
    finally:
        remove(path)
    f = f"/dev/shm/{unique_name('stream')}"
    try:
        with images(32 * MiB, "mixed") as imgs, peers("qemu", "qmigd", imgs) as (src, dst):
            src.set_migration(False, 2, "legacy", 0)
            dst.set_migration(False, 2)
            src.qmp.cmd("migrate", channels=main_channel(
                {"transport": "exec", "args": ["/bin/sh", "-c", f"cat > {f}.part && mv {f}.part {f}"]}))
            wait_status(src, ("completed",), timeout=120)
            wait_file(f)
            dst.qmp.cmd("migrate-incoming", channels=main_channel(
                {"transport": "exec", "args": ["cat", f]}))
            wait_status(dst, ("completed",), timeout=120)
            check(files_equal(imgs[0][1], imgs[0][2]), "QEMU -> qmigd over exec args differs")
    finally:
        remove(f, f + ".part")


if __name__ == "__main__":
    main()
