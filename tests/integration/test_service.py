#!/usr/bin/env python3
"""qmigd as a host service, without systemd: the notify protocol spoken to
a socket of the test's own (READY=1 once the monitor and --incoming
listen, STATUS= lines through a migration, WATCHDOG=1 at half of
WATCHDOG_USEC, STOPPING=1 at quit; a path and an abstract name), log lines
with their syslog priority on a journal stream, and the unit files as
systemd-analyze reads them."""
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from itest import test, main, check, skip
from fixtures import images, MiB
from runner import sandbox_spawning, Peer, QMIGD, unique_name, wait_status, start_incoming, files_equal, free_port
from qmp import QMP
import loop_watch

SIZE = 16 * MiB
UNITS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "systemd")


class NotifySocket:
    """A datagram socket standing in for the service manager's."""

    def __init__(self, abstract=False):
        name = unique_name("notify")
        self.path = f"/tmp/{name}.sock"
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

    def wait_for(self, text, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in m for m in self.read(0.05)):
                return
        raise AssertionError(f"no {text!r} in {self.read()}")

    def close(self):
        self.sock.close()
        if not self.address.startswith("\0"):
            os.unlink(self.path)


@test
def test_ready_status_watchdog_stopping():
    """A destination with --incoming: READY=1 only once its monitor answers
    and its migration port accepts; STATUS through a migration; pings at
    half the watchdog interval; STOPPING=1 at quit. Both socket kinds."""
    for abstract in (False, True):
        n = NotifySocket(abstract)
        with images(SIZE, "mixed") as imgs:
            port = free_port()
            d = s = None
            try:
                d = Peer("qmigd", "dest", [("mem", imgs[0][2], SIZE)], "svc-dst",
                         ["--incoming", f"tcp:127.0.0.1:{port}"], env=n.env(200000))
                n.wait_for("READY=1")
                # Ready means both listen now.
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                check(any("STATUS=destination: migration setup" in m for m in n.read()), n.read())
                t0 = time.monotonic()
                while time.monotonic() - t0 < 1.0:  # receive as they come: their times count
                    n.read(0.02)
                pings = [t for t, m in n.messages if "WATCHDOG=1" in m and t >= t0]
                check(len(pings) >= 5, f"{len(pings)} pings in 1 s at a 200 ms watchdog")
                gaps = [b - a for a, b in zip(pings, pings[1:])]
                check(max(gaps) < 0.2, f"a watchdog gap of {max(gaps):.3f} s")
                s = Peer("qmigd", "source", [("mem", imgs[0][1], SIZE)], "svc-src")
                s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
                wait_status(s, ("completed",), 30)
                wait_status(d, ("completed",), 30)
                n.wait_for("STATUS=destination: migration completed")
                check(any("STATUS=destination: migration active" in m for m in n.read()), n.read())
                check(files_equal(imgs[0][1], imgs[0][2]), "images differ")
                d.stop()
                d = None
                n.wait_for("STOPPING=1")
            finally:
                for p in (s, d):
                    if p:
                        p.stop()
                n.close()


@test
def test_a_manager_that_stops_reading():
    """A manager that stops reading its socket (busy, or gone with the
    socket left bound) does not stop the daemon: at a ping a millisecond
    its queue of 512 datagrams is full in half a second, and the monitor
    still answers within a second through the two seconds after. The
    daemon drops its pings rather than wait for room."""
    n = NotifySocket()  # never read
    with images(SIZE, "zero") as imgs:
        d = Peer("qmigd", "dest", [("mem", imgs[0][2], SIZE)], "svc-unread", env=n.env(2000))
        try:
            d.qmp.sock.settimeout(1.0)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.5:
                try:
                    d.qmp.cmd("query-status")
                except socket.timeout:
                    raise AssertionError(f"the monitor did not answer within 1 s, "
                                         f"{time.monotonic() - t0:.1f} s after the start")
                time.sleep(0.05)
        finally:
            d.stop()
            n.close()


@test
def test_stall_guard():
    """The suite's loop-stall guard (scripts/lib/loop_watch.py) fails a
    test whose daemon's loop was silent for more than a second: here a
    daemon stopped (SIGSTOP) for 1.5 s. The message has the gap and the
    daemon's log lines of that moment. Without a stall it stays quiet."""
    saved = loop_watch.STALL_GUARD
    loop_watch.STALL_GUARD = True
    try:
        with images(SIZE, "zero") as imgs:
            quiet = Peer("qmigd", "dest", [("mem", imgs[0][2], SIZE)], "svc-quiet")
            check(quiet.watch is not None, "no guard on a daemon of the harness")
            wait_for_pings(quiet.watch, 3)
            quiet.stop()
            d = Peer("qmigd", "dest", [("mem", imgs[0][2], SIZE)], "svc-stall")
            wait_for_pings(d.watch, 3)
            d.qmp.cmd("query-status")
            d.proc.send_signal(signal.SIGSTOP)
            time.sleep(1.5)  # the stall itself: what the guard must see
            d.proc.send_signal(signal.SIGCONT)
            wait_for_pings(d.watch, len(d.watch.pings) + 2)
            try:
                d.stop()
            except AssertionError as e:
                msg = str(e)
            else:
                raise AssertionError("a 1.5 s stall passed the guard")
            check(re.search(r"qmigd dest: its loop thread was silent for 1\.[5-9]\d s", msg), msg)
            check("qmigd info:" in msg and d.log_path in msg, msg)
    finally:
        loop_watch.STALL_GUARD = saved


def wait_for_pings(watch, count, timeout=10):
    deadline = time.monotonic() + timeout
    while len(watch.pings) < count:
        check(time.monotonic() < deadline, f"{len(watch.pings)} pings, {count} awaited")
        time.sleep(0.02)


@test
def test_exec_commands_do_not_inherit_the_manager():
    """An exec: command does not get NOTIFY_SOCKET or WATCHDOG_USEC (it
    would speak to the manager as qmigd); a malformed NOTIFY_SOCKET is
    ignored with a warning."""
    n = NotifySocket()
    with images(SIZE, "zero") as imgs:
        out = f"/tmp/{unique_name('svc-env')}.txt"
        with sandbox_spawning():
            s = Peer("qmigd", "source", [("mem", imgs[0][1], SIZE)], "svc-exec",
                     env=n.env(500000))
        try:
            n.wait_for("READY=1")
            s.qmp.cmd("migrate", uri=f"exec:env > {out}; cat > /dev/null")
            wait_status(s, ("completed",), 30)
            with open(out) as f:
                text = f.read()
            check("NOTIFY_SOCKET" not in text and "WATCHDOG_USEC" not in text, text)
        finally:
            s.stop()
            n.close()
            if os.path.exists(out):
                os.unlink(out)
        bad = Peer("qmigd", "source", [("mem", imgs[0][1], SIZE)], "svc-bad",
                   env=lambda log: {"NOTIFY_SOCKET": "relative/path"})
        try:
            bad.qmp.cmd("query-status")
            check("is neither a path nor an abstract name" in bad.log_text(), bad.log_text())
        finally:
            bad.stop()


@test
def test_journal_priorities():
    """On a journal stream (JOURNAL_STREAM names stderr) each line starts
    with its syslog priority and no timestamp; elsewhere lines keep theirs."""
    def journal(log):
        st = os.fstat(log.fileno())
        # A malformed NOTIFY_SOCKET: one warning among the info lines.
        return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}", "NOTIFY_SOCKET": "relative"}
    with images(SIZE, "zero") as imgs:
        d = Peer("qmigd", "dest", [("mem", imgs[0][2], SIZE)], "svc-journal", env=journal)
        d.stop()
        lines = [l for l in d.log_text().splitlines() if l]
        check(lines and all(re.match(r"<[0-7]>(info|warning|error|critical|debug): ", l)
                            for l in lines), lines)
        check(any(l.startswith("<6>info: ") for l in lines), lines)
        check(any(l.startswith("<4>warning: NOTIFY_SOCKET") for l in lines), lines)
        plain = Peer("qmigd", "dest", [("mem", imgs[0][2], SIZE)], "svc-plain")
        plain.stop()
        check(re.match(r"\d{4}-\d\d-\d\d ", plain.log_text()), plain.log_text()[:200])


@test
def test_units_verify():
    """systemd-analyze verify takes both units (with this build's qmigd)."""
    if not shutil.which("systemd-analyze"):
        skip("systemd-analyze is not installed")
    work = tempfile.mkdtemp(prefix="qmigd-units-")
    try:
        for role in ("dest", "source"):
            text = open(os.path.join(UNITS, f"qmigd-{role}@.service")).read()
            text = text.replace("/usr/bin/qmigd", os.path.abspath(QMIGD))
            text = text.replace(f"EnvironmentFile=/etc/qmigd/{role}-%i.env",
                                f"EnvironmentFile={work}/{role}-%i.env")
            unit = os.path.join(work, f"qmigd-{role}@test.service")
            with open(unit, "w") as f:
                f.write(text)
            with open(os.path.join(work, f"{role}-test.env"), "w") as f:
                f.write("QMIGD_ARGS=--ram-dir /var/lib/qmigd/test\n")
            r = subprocess.run(["systemd-analyze", "verify", "--man=no", unit],
                               capture_output=True, text=True)
            noise = [l for l in (r.stdout + r.stderr).splitlines()
                     if l and "network-online.target" not in l]
            check(r.returncode == 0 and not noise, f"{role}: {r.returncode} {noise}")
    finally:
        shutil.rmtree(work, True)


if __name__ == "__main__":
    main()
