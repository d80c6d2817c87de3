#!/usr/bin/env python3
"""The return path (capability return-path): the source sends
OPEN_RETURN_PATH and a PING after the header, the destination answers with
a PONG and, at its end, SHUT with its verdict; the source completes only on
SHUT(0). Byte-identical migrations with it QEMU 10 -> qmigd, qmigd -> QEMU 10
and qmigd -> qmigd (plain and multifd); a destination that fails is heard by
the source (it fails too, as a QEMU source does); a broken return path
(garbage, a wrong length, a close without SHUT) fails a qmigd source with
QEMU's words, and the daemon migrates again afterwards."""
import socket
import struct
import threading
import time

import wire
from itest import test, main, check
from fixtures import images, peers, MiB, good_run
from runner import Peer, start_incoming, wait_status, files_equal, migrate, remove, unique_name

SIZE = 32 * MiB
RP = [{"capability": "return-path", "state": True}]


def with_return_path(*peers_):
    for p in peers_:
        p.qmp.cmd("migrate-set-capabilities", capabilities=RP)


def cell(src_kind, dst_kind, multifd):
    def fn():
        with images(SIZE, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
            with_return_path(s, d)
            si, di, _ = migrate(s, d, multifd, 2, "multifd" if multifd else "legacy")
            check(si["status"] == "completed" and di["status"] == "completed", (si, di))
            check(files_equal(imgs[0][1], imgs[0][2]), "images differ")
            for p in (s, d):
                if p.kind == "qmigd":
                    check("return path: the destination says it is done" in p.log_text() or
                          p is d, "the qmigd source did not hear SHUT(0)")
    fn.__name__ = f"test_{src_kind}_to_{dst_kind}_{'multifd' if multifd else 'plain'}"
    test(fn)


for src_kind, dst_kind in (("qemu", "qmigd"), ("qmigd", "qemu"), ("qmigd", "qmigd")):
    for multifd in (False, True):
        cell(src_kind, dst_kind, multifd)


@test
def test_destination_failure_reaches_the_source():
    """A qmigd destination whose RAM block is of another size fails after
    the return path opened: it says SHUT(1), and a qmigd source fails with
    QEMU's words for that; a QEMU source fails too."""
    for src_kind in ("qmigd", "qemu"):
        with images(SIZE, "mixed") as imgs, peers(src_kind, "qmigd", imgs) as (s, d0):
            d0.stop()
            big = f"/dev/shm/{unique_name('rp-big')}.ram"
            d = Peer("qmigd", "dest", [("mem", big, 2 * SIZE)], "rp-big")
            try:
                with_return_path(s, d)
                port = start_incoming(d)
                s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
                si = wait_status(s, ("failed",), timeout=30, fail_on=("completed",))
                di = wait_status(d, ("failed",), timeout=30, fail_on=("completed",))
                check("Size mismatch" in di.get("error-desc", ""), di)
                if src_kind == "qmigd":
                    check(si.get("error-desc") == "Sibling indicated error 1", si)
                    check(s.qmp.cmd("query-status")["status"] == "running", "source not resumed")
                print(f"  {src_kind} source: {si.get('error-desc')!r}")
            finally:
                d.stop()
                remove(big)


class FakeDestination:
    """Accepts one migration, reads what comes, and answers on the return
    path with `reply` once the OPEN_RETURN_PATH command has come."""

    def __init__(self, reply, close_after=False):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.reply, self.close_after = reply, close_after
        self.saw_open = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        c, _ = self.srv.accept()
        c.settimeout(20)
        seen = b""
        open_cmd = b"\x08" + struct.pack(">HH", 1, 0)
        try:
            while open_cmd not in seen:
                chunk = c.recv(65536)
                if not chunk:
                    return
                seen += chunk
            self.saw_open.set()
            c.sendall(self.reply)
            if self.close_after:
                c.shutdown(socket.SHUT_WR)
            while c.recv(65536):
                pass
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self.srv.close()


def rp(type_, payload):
    return struct.pack(">HH", type_, len(payload)) + payload


RP_CASES = [
    ("garbage", rp(0x0009, b""), "Received invalid message 0x0009 length 0x0000"),
    ("bad_length", rp(1, b"\0\0\0\0\0"),
     "Received 'SHUT' message (0x0001) withincorrect length 5 expecting 4"),
    ("page_request", rp(4, bytes(12)), "'REQ_PAGES' message (0x0004) but postcopy is not running"),
    ("closed", b"", "the destination closed it without a SHUT"),
    ("shut_error", rp(2, b"\0\0\0\1") + rp(1, b"\0\0\0\7"), "Sibling indicated error 7"),
]


@test
def test_broken_return_path_fails_the_source():
    """What a destination sends back is input: each broken return path
    fails the qmigd source with QEMU's words, and it migrates again."""
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        with_return_path(s)
        for name, reply, want in RP_CASES:
            fake = FakeDestination(reply, close_after=(name == "closed"))
            try:
                s.set_migration(False, max_bandwidth=8 * MiB)  # still sending when it breaks
                s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{fake.port}")
                si = wait_status(s, ("failed",), timeout=30, fail_on=("completed",))
                check(fake.saw_open.is_set(), f"{name}: no OPEN_RETURN_PATH came")
                check(want in si.get("error-desc", ""), (name, si))
                check(s.qmp.cmd("query-status")["status"] == "running", name)
            finally:
                fake.close()
        with_return_path(d)
        s.set_migration(True, 2, "multifd")
        d.set_migration(True, 2)
        good_run(s, imgs, d)


@test
def test_return_path_refused_on_a_file():
    with images(4 * MiB, "zero") as imgs, peers("qmigd", "qmigd", imgs) as (s, _):
        with_return_path(s)
        path = f"/tmp/{unique_name('rp-file')}.mig"
        try:
            s.qmp.cmd("migrate", uri=f"file:{path}")
            si = wait_status(s, ("failed",), timeout=30, fail_on=("completed",))
            check("the return path needs a socket" in si.get("error-desc", ""), si)
        finally:
            remove(path)


if __name__ == "__main__":
    main()
