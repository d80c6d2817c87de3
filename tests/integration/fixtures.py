"""Shared pieces of the integration tests: images, peers, one migration."""
import atexit
import contextlib
import os
import shutil
import socket
import struct
import time

import wire

from runner import Peer, make_image, migrate, files_equal, remove, unique_name, PAGE
from runner import start_incoming, wait_status, stop_all
from itest import check
from waiting import wait_until, DEADLINE

MiB = 1 << 20
ODD_SIZE = 257 * MiB + 12 * 1024
_templates = {}


def template(size, content):
    """A cached source image of this size/content, copied per test."""
    key = (size, content)
    if key not in _templates:
        path = f"/dev/shm/{unique_name('tpl')}.ram"
        make_image(path, size, content, seed=size)
        _templates[key] = path
    return _templates[key]


def drop_templates():
    for p in _templates.values():
        remove(p)
    _templates.clear()


# Whatever way a test file ends, its /dev/shm templates go.
atexit.register(drop_templates)


@contextlib.contextmanager
def images(size, content, dest="fresh", blocks=("mem",)):
    """Yields [(name, src_path, dst_path, size)]; removes the files after."""
    made = []
    try:
        for i, name in enumerate(blocks):
            src = f"/dev/shm/{unique_name('src')}.ram"
            dst = f"/dev/shm/{unique_name('dst')}.ram"
            shutil.copyfile(template(size, content if i == 0 else "random"), src)
            if dest == "garbage":
                make_image(dst, size, "garbage")
            made.append((name, src, dst, size))
        yield made
    finally:
        for _, src, dst, _ in made:
            remove(src, dst)


def hand_over_socketpair(src, dst):
    """Each side gets one end of a socketpair through getfd as "mig", as
    libvirt hands QEMU a socket it connected itself; ours are closed."""
    a, b = socket.socketpair()
    try:
        dst.qmp.cmd("getfd", fd=a.fileno(), fdname="mig")
        src.qmp.cmd("getfd", fd=b.fileno(), fdname="mig")
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def peers(src_kind, dst_kind, imgs, src_extra=None, dst_extra=None):
    src = dst = None
    try:
        src = Peer(src_kind, "source", [(n, s, z) for n, s, _, z in imgs], "src", src_extra)
        dst = Peer(dst_kind, "dest", [(n, d, z) for n, _, d, z in imgs], "dst", dst_extra)
        yield src, dst
    finally:
        stop_all(src, dst)


class HeldPeers:
    """A qmigd source and destination with their images, kept across many
    test cases (close() at the end): suites that break one daemon again and
    again and check it still migrates."""

    def __init__(self, size, content):
        self.size = size
        self._images = images(size, content)
        self.imgs = self._images.__enter__()
        self._peers = peers("qmigd", "qmigd", self.imgs)
        self.src, self.dst = self._peers.__enter__()

    def close(self):
        self._peers.__exit__(None, None, None)
        self._images.__exit__(None, None, None)


def run_cell(src_kind, dst_kind, size, content, multifd, channels, zpd, dest="fresh",
             blocks=("mem",), unix_path=None, params=None):
    """One migration; checks status and byte-identical images. Returns src info."""
    with images(size, content, dest, blocks) as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
        src_info, dst_info, secs = migrate(s, d, multifd, channels, zpd, unix_path=unix_path,
                                           params=params)
        check(src_info["status"] == "completed", src_info)
        check(dst_info["status"] == "completed", dst_info)
        for name, sp, dp, _ in imgs:
            check(files_equal(sp, dp), f"RAM block {name} differs after migration")
        return src_info


SLOW = 32 * MiB  # max-bandwidth that makes a 64 MiB migration take ~2 s


def begin(src, dst, bandwidth=SLOW):
    """Starts a slow multifd migration and returns once it is under way on
    both sides: the destination is active (it has every channel: main and
    multifd) and RAM is on the wire (the source counts bytes sent)."""
    src.set_migration(True, 2, "multifd", bandwidth)
    dst.set_migration(True, 2)
    port = start_incoming(dst)
    src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
    wait_status(src, ("active",), timeout=DEADLINE)
    wait_status(dst, ("active",), timeout=DEADLINE)
    last = {}

    def sending():
        info = last["info"] = src.status()
        check(info["status"] == "active", f"the source left active: {info}")
        return info.get("ram", {}).get("transferred")
    wait_until("the source to send RAM", sending, seen=lambda: last["info"])


def events_through(qmp, status="completed"):
    """Every event `qmp` has had, once the MIGRATION event with `status` is
    among them (with "completed": all of a migration's events), and a
    command's round trip after it: what the peer sent before answering
    that is in too."""
    def came():
        return any(e["event"] == "MIGRATION" and e.get("data", {}).get("status") == status
                   for e in qmp.poll_events())
    wait_until(f"the MIGRATION {status} event on {qmp.path}", came,
               seen=lambda: [e["event"] for e in qmp.events])
    qmp.cmd("query-status")
    return qmp.events


def good_run(src, imgs, dst):
    """A full migration that must leave identical images."""
    _, s, d, _ = imgs[0]
    migrate(src, dst, True, 2, "multifd")
    check(files_equal(s, d), "images differ after the follow-up migration")


def good_run_with_new(kind, role, imgs, other):
    """A good migration with a fresh `kind` peer in `role`, replacing one
    that went away, and `other` on the far side."""
    ram = [(n, d if role == "dest" else s, z) for n, s, d, z in imgs]
    new = Peer(kind, role, ram, role + "2")
    try:
        good_run(other, imgs, new) if role == "dest" else good_run(new, imgs, other)
    finally:
        new.stop()


class NotifySocket:
    """A datagram socket standing in for the service manager's, in `dir`
    (or the abstract namespace)."""

    def __init__(self, abstract=False, dir="/tmp"):
        name = unique_name("notify")
        self.path = os.path.join(dir, f"{name}.sock")
        self.address = ("\0" + name) if abstract else self.path
        self.env_value = ("@" + name) if abstract else self.path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.address)
        self.messages = []  # (monotonic time, text)

    def env(self, watchdog_usec=None):
        extra = {"NOTIFY_SOCKET": self.env_value}
        if watchdog_usec:
            extra["WATCHDOG_USEC"] = str(watchdog_usec)
        return lambda log: extra

    def read(self, timeout=0.0):
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(4096)
                self.messages.append((time.monotonic(), data.decode()))
                self.sock.settimeout(0.001)
        except (socket.timeout, BlockingIOError):
            pass
        return [m for _, m in self.messages]

    def wait_for(self, text, timeout=DEADLINE):
        def said():
            # read() waits up to 50 ms for a datagram: the poll's own pace.
            return any(text in m for m in self.read(0.05))
        wait_until(f"{text!r} on the notify socket", said, timeout, every=0, seen=self.read)

    def close(self):
        self.sock.close()
        if not self.address.startswith("\0"):
            os.unlink(self.path)


def resume_parked_to_qemu(directory, tag, want_img, work):
    """qmigd source --ram-dir directory -> a QEMU -M none destination (one
    block "mem" of want_img's size, its RAM in `work`): both complete and
    the RAM is want_img's."""
    size = os.path.getsize(want_img)
    img = os.path.join(work, unique_name(tag) + ".ram")
    src = Peer("qmigd", "source", [], tag + "-src", extra=["--ram-dir", directory])
    dst = None
    try:
        # Inside: a destination that fails to start leaves no source running.
        dst = Peer("qemu", "dest", [("mem", img, size)], tag + "-dst")
        si, di, _ = migrate(src, dst, False, 1, "legacy")
        check(si["status"] == "completed" and di["status"] == "completed", (si, di))
        check(files_equal(want_img, img), "the resumed RAM differs")
    finally:
        try:
            stop_all(src, dst)
        finally:
            remove(img)


def stranger(port, data=b"", reset=False):
    """A connection to a migration port that sends `data` and goes: closed,
    or reset (SO_LINGER 0: a scanner's RST) when `reset`."""
    s = socket.create_connection(("127.0.0.1", port))
    try:
        if data:
            s.sendall(data)
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        s.close()


# Before the source: a probe, a reset, a byte, part of a header or of a TLS
# record, part of a multifd init.
SETUP_STRANGERS = [(b"", False), (b"", True), (b"Q", False), (b"QE", True),
                   (b"\x16\x03", False), (b"\x11\x22\x33\x44", False), (b"\0" * 40, True)]
# While the source's channels load: a main channel's header, multifd inits
# with the destination's UUID (all zeros: it has none of its own), a reset.
ACTIVE_STRANGERS = [(wire.header(), False), (wire.multifd_init(0), False),
                    (wire.multifd_init(1), True), (b"", True), (b"QEVM", False)]


def strangers_cannot_end_it(s, d, imgs, multifd, params=None,
                            ignored="Extra incoming migration connection; ignoring"):
    """Strangers on d's migration port, before the source comes and while
    it loads (the source held at 2 MiB/s meanwhile), end nothing: the
    migration completes byte-identical. `ignored`: what d's log says of
    the strangers that came while it loaded."""
    s.set_migration(multifd, 2, "multifd", max_bandwidth=2 * MiB, extra_params=params)
    d.set_migration(multifd, 2, extra_params=params)
    port = start_incoming(d)
    # Without multifd (or TLS) the first connection to send 4 bytes is the
    # main channel, as in QEMU: only what sends less is a stranger there.
    for data, reset in SETUP_STRANGERS:
        if multifd or params or len(data) < 4:
            stranger(port, data, reset)
    wait_until("the strangers to be dropped",
               lambda: "ended before they identified themselves" in d.log_text())
    check(d.status()["status"] == "setup", f"strangers ended the setup: {d.status()}")
    s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
    wait_status(d, ("active",), timeout=60)
    for data, reset in ACTIVE_STRANGERS:
        stranger(port, data, reset)
    wait_until("the strangers to be ignored", lambda: ignored in d.log_text())
    check(d.status()["status"] == "active", f"strangers ended the load: {d.status()}")
    s.qmp.cmd("migrate-set-parameters", **{"max-bandwidth": 0})
    wait_status(s, ("completed",), timeout=120)
    wait_status(d, ("completed",), timeout=120)
    _, sp, dp, _ = imgs[0]
    check(files_equal(sp, dp), "the RAM differs after strangers came")
