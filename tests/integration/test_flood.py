#!/usr/bin/env python3
"""Strangers on the migration port while a real migration runs: floods of
idle connections, of a few bytes of a multifd header, of stalled TLS
ClientHellos, of TLS clients that finish a handshake (verify-peer off) and
then say nothing, and of garbage once the migration is active. Each time a
qmigd -> qmigd migration beside the flood completes byte for byte, the
destination's descriptors, threads and RSS stay bounded, and it still
serves its monitor. Prints, per flood, the connections tried, the peaks,
and the migration's time against the time without a flood."""
import os
import random
import resource
import socket
import ssl
import struct
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "lib"))
import tls_certs  # noqa: E402
from itest import test, main, check, cleanup  # noqa: E402
from fixtures import images, peers, MiB  # noqa: E402
from runner import start_incoming, wait_status, files_equal, proc_status  # noqa: E402
from waiting import wait_until  # noqa: E402

SIZE = 64 * MiB
BANDWIDTH = 48 * MiB  # about a second of migration: long enough to flood into
FLOOD = int(os.environ.get("QMIGD_FLOOD_CONNECTIONS", "2000"))
ROOT = tempfile.mkdtemp(prefix="qmigd-flood-")
_certs = {}

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def certs():
    if not _certs:
        ca = tls_certs.CA(ROOT)
        _certs["server"] = ca.issue(f"{ROOT}/server", "server", "localhost")
        _certs["client"] = ca.issue(f"{ROOT}/client", "client", "qmigd client")
    return _certs


def usage(pid):
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    st = proc_status(pid)
    return fds, int(st.get("Threads", "0")), int(st.get("VmRSS", "0").split()[0]) // 1024


class Sampler(threading.Thread):
    """Peaks of a process's descriptors, threads and RSS (MiB)."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.stop, self.peak = pid, threading.Event(), [0, 0, 0]

    def run(self):
        while not self.stop.is_set():
            try:
                self.peak = [max(a, b) for a, b in zip(self.peak, usage(self.pid))]
            except OSError:
                pass
            time.sleep(0.01)  # a sample every 10 ms: the peaks' resolution


class Flood(threading.Thread):
    """Opens up to FLOOD connections, each doing `one(sock)`, keeping the
    newest `keep` open on our side, until stopped."""

    def __init__(self, port, one, total=FLOOD, keep=1500, when=None):
        super().__init__(daemon=True)
        self.port, self.one, self.total, self.keep, self.when = port, one, total, keep, when
        self.stop, self.tried, self.held = threading.Event(), 0, []

    def run(self):
        if self.when:
            self.when.wait()
        while self.tried < self.total and not self.stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                self.tried += 1
                self.one(s)
                self.held.append(s)
            except OSError:
                self.tried += 1
                continue
            if len(self.held) > self.keep:
                self.held.pop(0).close()

    def close(self):
        self.stop.set()
        self.join(30)
        for s in self.held:
            s.close()


def idle(s):
    pass


def multifd_header_start(s):
    s.sendall(struct.pack(">II", 0x11223344, 1))  # 8 of the 64 bytes of an init message


def paced(one, secs):
    def fn(s):
        one(s)
        time.sleep(secs)
    return fn


def tls_hello_start(s):
    s.sendall(b"\x16\x03\x01\x00")  # a TLS record header that never goes on


def garbage(s):
    s.sendall(random.randbytes(64))
    s.close()


_ctx = ssl.create_default_context()
_ctx.check_hostname = False
_ctx.verify_mode = ssl.CERT_NONE


def tls_then_silent(s):
    s.settimeout(10)
    return _ctx.wrap_socket(s, server_hostname="localhost")  # a whole handshake, then nothing


class SilentTls(Flood):
    def run(self):
        while self.tried < self.total and not self.stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                self.tried += 1
                self.held.append(tls_then_silent(s))
            except OSError:
                continue
            if len(self.held) > self.keep:
                self.held.pop(0).close()


def migrate_beside(make_flood=None, tls=False, verify_peer=True):
    """A migration with `make_flood(port, active_event)` running beside it;
    returns (seconds, peaks, connections tried)."""
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        params = {}
        if tls:
            c = certs()
            for p, role, dir_ in ((s, "client", c["client"]), (d, "server", c["server"])):
                p.qmp.cmd("object-add", **{"qom-type": "tls-creds-x509", "id": "tls0",
                                           "dir": dir_, "endpoint": role,
                                           "verify-peer": verify_peer if role == "server" else True})
            params = {"tls-creds": "tls0"}
        s.set_migration(True, 2, "multifd", BANDWIDTH, extra_params=params)
        d.set_migration(True, 2, extra_params=params)
        port = start_incoming(d)
        sampler = Sampler(d.proc.pid)
        sampler.start()
        active = threading.Event()
        flood = make_flood(port, active) if make_flood else None
        if flood:
            flood.start()
            # The flood is well on before the source comes, unless it waits
            # for the migration to be active: 600 connects made, of which the
            # kernel's accept queue holds 65 at most, so the daemon has taken
            # more than its 256 places' worth.
            if not flood.when:
                want = min(flood.total, 600)
                wait_until(f"{want} connections of the flood",
                           lambda: flood.tried >= want or not flood.is_alive(),
                           seen=lambda: flood.tried)
        try:
            t0 = time.monotonic()
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            wait_status(s, ("active",), timeout=60)
            active.set()
            wait_status(s, ("completed",), timeout=120)
            wait_status(d, ("completed",), timeout=120)
            secs = time.monotonic() - t0
        finally:
            active.set()
            if flood:
                flood.close()
            sampler.stop.set()
            sampler.join()
        check(files_equal(imgs[0][1], imgs[0][2]), "images differ after a migration beside a flood")
        check(d.proc.poll() is None and "return" in d.qmp.execute("query-status"))
        return secs, sampler.peak, flood.tried if flood else 0


_base = {}


def baseline(tls):
    if tls not in _base:
        _base[tls] = migrate_beside(tls=tls)
    return _base[tls]


def flood_case(name, make_flood, tls=False, verify_peer=True, threads_bound=None):
    def fn():
        base_secs, base_peak, _ = baseline(tls)
        secs, peak, tried = migrate_beside(make_flood, tls, verify_peer)
        fds, threads, rss = peak
        print(f"  {name}: {tried} connections; destination peak {fds} fds, {threads} threads, "
              f"{rss} MiB RSS (without a flood: {base_peak[0]} fds, {base_peak[1]} threads, "
              f"{base_peak[2]} MiB); migration {secs:.2f} s against {base_secs:.2f} s", flush=True)
        check(tried >= 50, f"only {tried} connections were made")
        # Strangers hold at most 256 pending connections, or 32 TLS
        # handshakes (64 threads while ended ones finish).
        check(fds < base_peak[0] + 256 + 70, f"{fds} descriptors")
        check(threads < base_peak[1] + (threads_bound or 8), f"{threads} threads")
        check(rss < base_peak[2] + 200, f"RSS {rss} MiB")
    fn.__name__ = "test_flood_" + name
    test(fn)


flood_case("idle", lambda port, _: Flood(port, idle))
flood_case("multifd_header_start", lambda port, _: Flood(port, multifd_header_start))
flood_case("garbage_while_active", lambda port, active: Flood(port, garbage, when=active))
flood_case("tls_stalled_hello", lambda port, _: Flood(port, tls_hello_start), tls=True,
           threads_bound=70)
flood_case("tls_silent_after_handshake", lambda port, _: SilentTls(port, None, total=300),
           tls=True, verify_peer=False, threads_bound=70)


@test
def test_strangers_are_dropped_after_their_deadline():
    """A connection that does not identify itself within the deadline
    (--link-timeout here, 10 s at most) is closed; the listener goes on."""
    with images(16 * MiB, "mixed") as imgs, \
            peers("qmigd", "qmigd", imgs, dst_extra=["--link-timeout", "1500"]) as (s, d):
        d.set_migration(True, 2)
        s.set_migration(True, 2, "multifd")
        port = start_incoming(d)
        # Before the connects: the daemon's deadline counts from its accept,
        # after them, so no stranger can be closed sooner than 1.5 s from here.
        t0 = time.monotonic()
        strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        strangers[0].sendall(struct.pack(">I", 0x11223344))
        for c in strangers:
            c.settimeout(60)
        for c in strangers:
            check(c.recv(1) == b"", "a stranger's connection was kept")
        took = time.monotonic() - t0
        # A latency test on the upper side: the sweep comes every 375 ms, and
        # without --link-timeout the deadline would be 10 s.
        check(1.45 < took < 8, f"closed after {took:.2f} s")
        check(d.status()["status"] == "setup", d.status())
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(s, ("completed",), 60)
        wait_status(d, ("completed",), 60)
        check(files_equal(imgs[0][1], imgs[0][2]))
        for c in strangers:
            c.close()


@test
def test_a_silent_channel_outlives_a_flood_of_stalled_prefixes():
    """A connection that has not spoken yet (a source's multifd channel
    waits for its main channel's TLS handshake) is not ended by a flood of
    connections that sent part of a header and stopped, three times its
    places; once it speaks, it is a channel like any other."""
    with images(16 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        d.set_migration(True, 2)
        port = start_incoming(d)
        silent = socket.create_connection(("127.0.0.1", port))
        # Paced so that the daemon has read each prefix before the next
        # comes (bytes it has not read yet count as none sent): a sanitizer
        # build reads far slower than an unpaced flood connects.
        t0 = time.monotonic()
        # 800: three times the table, in seconds, well within the silent
        # connection's deadline (10 s), which would end it too.
        flood = Flood(port, paced(multifd_header_start, 0.002), total=800)
        flood.start()
        flood.join(60)
        check(flood.tried >= 600, f"only {flood.tried} connections were made")
        # Once the daemon has taken every connection, 256 are open and it
        # has ended the others: the silent one must be among the open.
        held = flood.held + [silent]
        wait_until("the daemon to end all but 256 of the connections",
                   lambda: len(held) - sum(map(ended, held)) <= 256,
                   seen=lambda: f"{len(held) - sum(map(ended, held))} open of {len(held)}")
        took = time.monotonic() - t0
        check(not ended(silent), "the silent connection was ended by the flood" +
              (f" or by its 10 s deadline: the flood took {took:.1f} s" if took > 9 else ""))
        check(d.status()["status"] == "setup", d.status())
        flood.close()  # half-sent headers that end fail the incoming migration
        silent.close()


def ended(s):
    """Whether the daemon has closed our connection `s`."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@cleanup
def remove_shared():
    import shutil
    shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()
