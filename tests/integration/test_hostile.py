#!/usr/bin/env python3
"""Hostile clients and stuck peers: no QMP input crashes or bloats a daemon,
quit and SIGTERM end it at once whatever it waits for, and a daemon that
got such input keeps serving (issue: hostile peers, clients and networks)."""
import json
import os
import signal
import socket
import subprocess
import time

from itest import test, main, check
from fixtures import images, peers, MiB
from runner import Peer, QMP, QMIGD, unique_name, remove, wait_status, start_incoming

SIZE = 16 * MiB


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
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


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


@each_role
def test_client_that_never_reads(p):
    """4 MB of requests whose replies are never read: the daemon stops
    reading that client instead of queueing replies without bound."""
    s = raw_client(p.qmp_path)
    s.setblocking(False)
    before = rss_kib(p.proc.pid)
    req = b'{"execute": "query-migrate-parameters"}\n'
    sent, blocked_since = 0, None
    while sent < 4 << 20:
        try:
            sent += s.send(req * 256)
            blocked_since = None
        except BlockingIOError:
            # The daemon stopped reading us, as it should: for good?
            blocked_since = blocked_since or time.monotonic()
            if time.monotonic() - blocked_since > 2:
                break
            time.sleep(0.01)
    time.sleep(0.5)
    grown = rss_kib(p.proc.pid) - before
    check(grown < 32 * 1024, f"RSS grew by {grown} KiB for an unread client")
    # Others are still served.
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
    time.sleep(0.2)
    return srv, fillers, port


def migrate_to_silent_host(stop):
    with images(SIZE, "zero") as imgs:
        srv, fillers, port = silent_listener()
        src = Peer("qmigd", "source", [(n, s, z) for n, s, _, z in imgs], "silent")
        try:
            src.set_migration(True, 2, "multifd")
            src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            time.sleep(0.5)
            check(src.status()["status"] == "setup", src.status())
            t0 = time.monotonic()
            stop(src)
            src.proc.wait(timeout=10)
            took = time.monotonic() - t0
            check(took < 3, f"exit took {took:.1f}s while connecting")
            check(src.proc.returncode == 0, f"exit code {src.proc.returncode}")
        finally:
            src.stop()
            srv.close()
            for c in fillers:
                c.close()


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
            time.sleep(0.3)
            s.qmp.cmd("migrate_cancel")
            wait_status(s, ("cancelled",), timeout=3, fail_on=("failed",))
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
            info = wait_status(src, ("failed",), timeout=30, fail_on=())
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


if __name__ == "__main__":
    main()
