#!/usr/bin/env python3
"""Hostile clients and stuck peers: no QMP input crashes or bloats a daemon,
quit and SIGTERM end it at once whatever it waits for, and a daemon that
got such input keeps serving (issue: hostile peers, clients and networks)."""
import array
import fcntl
import json
import os
import signal
import socket
import subprocess
import termios
import time

from itest import test, main, check
from fixtures import images, peers, MiB, strangers_cannot_end_it
from runner import Peer, QMP, QMIGD, unique_name, remove, wait_status, start_incoming, proc_status
from waiting import wait_until, tcp_sockets, accept_queue

SIZE = 16 * MiB
# A latency bound: quit, SIGTERM and migrate_cancel end a connect at once;
# one that waited for it would wait for the kernel's SYN retries (~2 min).
PROMPT_SECS = 10


def raw_client(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(20)
    return s


def read_replies(s, n):
    """Reads n CRLF-terminated JSON replies (greeting included if unread)."""
    buf = b""
    out = []
    while len(out) < n:
        chunk = s.recv(65536)
        check(chunk, f"connection closed after {len(out)} replies")
        buf += chunk
        while b"\r\n" in buf and len(out) < n:
            line, buf = buf.split(b"\r\n", 1)
            out.append(json.loads(line))  # strict: valid UTF-8 JSON or this raises
    return out


def rss_kib(pid):
    return int(proc_status(pid).get("VmRSS", "0").split()[0])  # 0 once it has exited


def each_role(fn):
    """Runs fn(peer) against a qmigd source and a qmigd destination."""
    def run():
        with images(SIZE, "zero") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
            for p in (s, d):
                fn(p)
                check(p.proc.poll() is None, f"qmigd {p.role} died")
                check(p.qmp.cmd("query-status")["status"] in ("running", "inmigrate"))
    run.__name__ = fn.__name__
    return test(run)


@each_role
def test_deep_nesting_before_negotiation(p):
    """QEMU caps nesting at 1024 and answers with an error; so must we,
    before qmp_capabilities too, and the same connection keeps working."""
    s = raw_client(p.qmp_path)
    read_replies(s, 1)  # greeting
    s.sendall(b"[" * 200000)
    s.sendall(b"]" * 200000 + b'\n{"execute": "qmp_capabilities"}\n')
    r = read_replies(s, 2)
    check(r[0] == {"error": {"class": "GenericError",
                             "desc": "JSON nesting depth limit exceeded"}}, r[0])
    check(r[1] == {"return": {}}, r[1])
    s.sendall(b'{"execute": "query-status"}\n')
    check("return" in read_replies(s, 1)[0])
    s.close()


@each_role
def test_deep_nesting_objects_and_arrays(p):
    s = raw_client(p.qmp_path)
    read_replies(s, 1)
    deep = b'{"a":' * 600 + b"[" * 600
    s.sendall(deep + b"1" + b"]" * 600 + b"}" * 600 + b'\n{"execute": "qmp_capabilities"}\n')
    r = read_replies(s, 2)
    check(r[0]["error"]["desc"] == "JSON nesting depth limit exceeded", r[0])
    check(r[1] == {"return": {}}, r[1])
    s.close()


def unread_bytes(s):
    """Bytes sent on a unix stream socket that its peer has not read yet."""
    buf = array.array("i", [0])
    fcntl.ioctl(s, termios.TIOCOUTQ, buf)  # SIOCOUTQ
    return buf[0]


@each_role
def test_client_that_never_reads(p):
    """4 MB of requests whose replies are never read: the daemon stops
    reading that client instead of queueing replies without bound."""
    s = raw_client(p.qmp_path)
    s.setblocking(False)
    other = QMP(p.qmp_path)
    before = rss_kib(p.proc.pid)
    req = b'{"execute": "query-migrate-parameters"}\n'
    sent = 0
    while sent < 4 << 20:
        try:
            sent += s.send(req * 256)
            continue
        except BlockingIOError:
            pass
        # Our bytes back up. The daemon stopped reading us for good if it
        # served another client meanwhile and took none of them: its loop
        # reads every readable client it still reads from in the turn that
        # serves the other one (ours were waiting all along).
        waiting = unread_bytes(s)
        check("return" in other.execute("query-status"), "another client was not served")
        if unread_bytes(s) == waiting:
            break
    # What it read is answered (queued) by now: the turn above came after.
    grown = rss_kib(p.proc.pid) - before
    # Unbounded, 4 MB of these requests queued 130 MB of replies; bounded,
    # the daemon stops reading long before the client has sent them all.
    check(sent < 4 << 20, f"the daemon read all {sent} bytes of an unread client's requests")
    check(grown < 100 * 1024, f"RSS grew by {grown} KiB for an unread client")
    # Others are still served, a newcomer too.
    other.close()
    q = QMP(p.qmp_path)
    check("return" in q.execute("query-status"))
    q.close()
    s.close()


@each_role
def test_reply_to_bad_utf8_request(p):
    s = raw_client(p.qmp_path)
    read_replies(s, 1)
    s.sendall(b'{"execute": "qmp_capabilities", "id": "\xff\xfe"}\n')
    r = read_replies(s, 1)
    check(r[0]["error"]["class"] == "GenericError", r[0])
    s.close()


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


@each_role
def test_descriptor_flood_is_not_kept(p):
    """A client passes hundreds of descriptors (SCM_RIGHTS) with requests
    that never name them, and with a getfd: the daemon keeps at most one
    per client and one per name, and closes the rest; nothing leaks when
    the client goes."""
    before = open_fds(p.proc.pid)
    s = raw_client(p.qmp_path)
    read_replies(s, 1)
    s.sendall(b'{"execute": "qmp_capabilities"}\n')
    read_replies(s, 1)
    r, w = os.pipe()
    try:
        for i in range(200):
            msg = b'{"execute": "query-status"}\n'
            socket.send_fds(s, [msg], [r, w] * 32)  # 64 descriptors a message
            read_replies(s, 1)
        socket.send_fds(s, [b'{"execute": "getfd", "arguments": {"fdname": "x"}}\n'], [r, w])
        got = read_replies(s, 1)[0]
        check("return" in got, got)
        held = open_fds(p.proc.pid) - before
        check(held <= 3, f"{held} descriptors held after 12,800 were passed")
        s.sendall(b'{"execute": "closefd", "arguments": {"fdname": "x"}}\n')
        check("return" in read_replies(s, 1)[0])
    finally:
        os.close(r)
        os.close(w)
        s.close()
    wait_until("the daemon to close the gone client's descriptors",
               lambda: open_fds(p.proc.pid) <= before,
               seen=lambda: f"{open_fds(p.proc.pid) - before} more than before it came")


def connecting(pid, port):
    """Whether process `pid` has a connect to `port` in flight (SYN_SENT)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return any(st == "02" and rport == port and inode in inodes
               for _, rport, st, _, inode in tcp_sockets())


def silent_listener():
    """A TCP port whose accept queue is full: connects to it hang, as to a
    host that does not answer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    # A backlog of 0 holds one: the kernel drops every SYN after it.
    wait_until("a filler in the silent listener's accept queue", lambda: accept_queue(port) >= 1)
    return srv, fillers, port


def migrate_to_silent_host(stop):
    with images(SIZE, "zero") as imgs:
        srv, fillers, port = silent_listener()
        src = Peer("qmigd", "source", [(n, s, z) for n, s, _, z in imgs], "silent")
        try:
            src.set_migration(True, 2, "multifd")
            src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            wait_until("the source's connect to the silent host",
                       lambda: connecting(src.proc.pid, port))
            check(src.status()["status"] == "setup", src.status())
            t0 = time.monotonic()
            stop(src)
            try:
                src.proc.wait(timeout=PROMPT_SECS)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"still running {PROMPT_SECS} s after being told to end "
                                     "while connecting")
            print(f"  ended {time.monotonic() - t0:.2f} s after being told to, while connecting")
            check(src.proc.returncode == 0, f"exit code {src.proc.returncode}")
        finally:
            src.stop()
            srv.close()
            for c in fillers:
                c.close()


@test
def test_strangers_cannot_end_an_incoming_migration():
    """A port scan, resets and half headers before the source, a main
    header and multifd inits with our (all-zero) UUID during the load: as
    QEMU 10, the destination ignores them and completes."""
    for multifd in (True, False):
        with images(SIZE, "random") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
            strangers_cannot_end_it(s, d, imgs, multifd)


@test
def test_quit_while_connecting():
    migrate_to_silent_host(lambda src: src.qmp.execute("quit"))


@test
def test_sigterm_while_connecting():
    migrate_to_silent_host(lambda src: src.proc.send_signal(signal.SIGTERM))


@test
def test_cancel_while_connecting_then_migrate():
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        srv, fillers, port = silent_listener()
        try:
            s.set_migration(True, 2, "multifd")
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            wait_until("the source's connect to the silent host",
                       lambda: connecting(s.proc.pid, port))
            s.qmp.cmd("migrate_cancel")
            wait_status(s, ("cancelled",), timeout=PROMPT_SECS, fail_on=("failed",))
        finally:
            srv.close()
            for c in fillers:
                c.close()
        from runner import migrate, files_equal
        migrate(s, d, True, 2, "multifd")
        check(files_equal(imgs[0][1], imgs[0][2]), "images differ")


@test
def test_unresolvable_host_fails_fast():
    with images(SIZE, "zero") as imgs:
        src = Peer("qmigd", "source", [(n, s, z) for n, s, _, z in imgs], "gai")
        try:
            src.qmp.cmd("migrate", uri="tcp:no-such-host.invalid:4444")
            info = wait_status(src, ("failed",), timeout=60, fail_on=())
            check("address resolution failed for no-such-host.invalid:4444" in
                  info.get("error-desc", ""), info)
        finally:
            src.stop()


@test
def test_incoming_on_all_interfaces():
    """QEMU's tcp::PORT form listens on every interface."""
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        d.set_migration(True, 2)
        s.set_migration(True, 2, "multifd")
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        d.qmp.cmd("migrate-incoming", uri=f"tcp::{port}")
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(s, ("completed",), timeout=60)
        wait_status(d, ("completed",), timeout=60)
        from runner import files_equal
        check(files_equal(imgs[0][1], imgs[0][2]), "images differ")


# --- the switchover: the guest, the run state, the status order ---------

class GuestRun:
    """A qmigd source with a `qmigd guest` writing its RAM, a qmigd
    destination, events on; `frozen` SIGSTOPs the guest so it never
    acknowledges a pause."""

    def __init__(self, imgs, s, d, frozen=False, bandwidth=0):
        from runner import Guest
        self.imgs, self.src, self.dst = imgs, s, d
        self.guest = Guest(imgs[0][1], rate=2000, pattern="hot", hot_set=4 * MiB)
        if frozen:
            self.guest.proc.send_signal(signal.SIGSTOP)
        for side in (s, d):
            side.qmp.cmd("migrate-set-capabilities",
                         capabilities=[{"capability": "events", "state": True}])
        s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": bandwidth})
        self.port = start_incoming(d)

    def migrate(self):
        self.src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{self.port}")

    def close(self):
        self.guest.proc.send_signal(signal.SIGCONT)
        self.guest.stop()


@test
def test_guest_that_never_pauses_is_left_running():
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        g = GuestRun(imgs, s, d, frozen=True)
        try:
            g.migrate()
            info = wait_status(s, ("failed",), timeout=60, fail_on=("completed",))
            check("did not acknowledge the pause" in info.get("error-desc", ""), info)
            check(s.qmp.cmd("query-status")["status"] == "running")
            check(g.guest.record()[0] == 0, f"pause still requested: {g.guest.record()}")
        finally:
            g.close()


# The source's wait for a guest's pause acknowledgement (stop_for_switchover).
PAUSE_TIMEOUT = 5.0


@test
def test_cancel_while_waiting_for_the_pause():
    """migrate_cancel interrupts the wait for the guest's pause; the status
    only moves forward (no device, STOP or RESUME after cancelling) and the
    guest runs again."""
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        g = GuestRun(imgs, s, d, frozen=True)
        try:
            g.migrate()
            wait_status(s, ("active",), timeout=60)
            # All sent: the source asks the frozen guest to pause and waits.
            wait_until("the source to ask the guest to pause", lambda: g.guest.record()[0] == 1,
                       seen=g.guest.record)
            t0 = time.monotonic()
            s.qmp.cmd("migrate_cancel")
            wait_status(s, ("cancelled",), timeout=60, fail_on=("failed", "completed"))
            took = time.monotonic() - t0
            # A latency test: a cancel that did not interrupt the wait would
            # end with it, PAUSE_TIMEOUT after the request (just before t0).
            check(took < PAUSE_TIMEOUT - 2,
                  f"cancel took {took:.2f} s: it waited for the pause timeout")
            # The guest wakes only now: woken before, it could acknowledge
            # the pause before the source saw the cancel.
            g.guest.proc.send_signal(signal.SIGCONT)
            # Events come before the replies that follow them: this one
            # orders every event of the cancel before it.
            check(s.qmp.cmd("query-status")["status"] == "running")
            events = s.qmp.poll_events()
            seq = [e["data"]["status"] for e in events if e["event"] == "MIGRATION"]
            check(seq[-2:] == ["cancelling", "cancelled"] and "device" not in seq, seq)
            check(not any(e["event"] in ("STOP", "RESUME") for e in events), events)
            # Withdrawn before `cancelled` was set (resume_guest_if_running).
            check(g.guest.record()[0] == 0, f"pause still requested: {g.guest.record()}")
            w = g.guest.pages_written()
            wait_until("the guest to write again", lambda: g.guest.pages_written() > w)
            check(g.guest.record()[0] == 0, f"pause requested again: {g.guest.record()}")
        finally:
            g.close()


def switchover_state(before, during, bandwidth):
    """The run state the destination starts in follows the source's run
    state at switchover, not at `migrate`."""
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        g = GuestRun(imgs, s, d, bandwidth=bandwidth)
        try:
            if before:
                s.qmp.cmd(before)
            g.migrate()
            wait_status(s, ("active",), timeout=60)
            s.qmp.cmd(during)
            wait_status(s, ("completed",), timeout=60)
            wait_status(d, ("completed",), timeout=30)
            return d.qmp.cmd("query-status")["status"]
        finally:
            g.close()


@test
def test_stop_during_migration_keeps_destination_paused():
    st = switchover_state(None, "stop", 4 * MiB)  # the paused guest lets it converge
    check(st == "paused", f"destination is {st}")


@test
def test_cont_during_migration_starts_destination():
    st = switchover_state("stop", "cont", 16 * MiB)  # beats the guest's 8 MiB/s
    check(st == "running", f"destination is {st}")


# --- options and monitor values QEMU refuses ------------------------------

@test
def test_size_that_wraps_is_refused():
    img = f"/dev/shm/{unique_name('wrap')}.ram"
    r = subprocess.run([QMIGD, "dest", "--qmp", f"/tmp/{unique_name('wrap')}.qmp",
                        "--ram", f"mem={img},size=16777216T"], capture_output=True, text=True,
                       timeout=30)
    check(r.returncode != 0 and "Parameter 'size' expects a size value" in r.stderr, r)
    check(not os.path.exists(img), "an image was created")


@test
def test_qmp_path_too_long():
    path = "/tmp/" + "q" * 120
    img = f"/dev/shm/{unique_name('long')}.ram"
    try:
        r = subprocess.run([QMIGD, "dest", "--qmp", path, "--ram", f"mem={img},size=1M"],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode != 0 and f"UNIX socket path '{path}' is too long" in r.stderr, r)
    finally:
        remove(img)


@test
def test_smaller_image_is_refused_not_grown():
    img = f"/dev/shm/{unique_name('small')}.ram"
    try:
        with open(img, "wb") as f:
            f.write(b"\x5a" * (1 << 20))
        r = subprocess.run([QMIGD, "source", "--qmp", f"/tmp/{unique_name('small')}.qmp",
                            "--ram", f"mem={img},size=2M"], capture_output=True, text=True,
                           timeout=30)
        check(r.returncode != 0 and "is too small for 'size' option 0x200000" in r.stderr, r)
        check(os.path.getsize(img) == 1 << 20, "the guest's file was resized")
    finally:
        remove(img)


if __name__ == "__main__":
    main()
