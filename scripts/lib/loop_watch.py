"""The loop-stall guard: the service manager's side of qmigd's notify
protocol, for the tests.

Every qmigd a test starts through runner.Peer gets NOTIFY_SOCKET (a
datagram socket owned here) and a short WATCHDOG_USEC, so its loop thread
sends WATCHDOG=1 every 100 ms. A thread here reads the datagrams as they
come; each is stamped by the kernel when it arrives (SO_TIMESTAMPNS), so a
busy test process reading late does not make a gap of its own. When the
test stops the daemon, a loop that was silent for more than STALL_LIMIT
seconds while it lived fails the test, with the gap, when it was, and the
daemon's log lines around it. The count ends at the daemon's STOPPING=1
(quit or a signal reached its loop), also kernel-stamped: what the
process does after that (threads joined, images unmapped) is not the
loop's silence, and the time a busy test takes to see the exit is not the
daemon's at all.

On when QMIGD_STALL_GUARD=on (the release build's ctest sets it), and only
for daemons whose test does not speak the notify protocol itself.
"""
import datetime
import os
import socket
import struct
import threading
import time

STALL_GUARD = os.environ.get("QMIGD_STALL_GUARD", "") == "on"
WATCHDOG_USEC = 200_000  # a ping every 100 ms
STALL_LIMIT = 1.0
# Linux's values where Python does not name them (x86_64 and most others).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SCM_TIMESTAMPNS = SO_TIMESTAMPNS


class LoopWatch:
    """One daemon's watchdog pings. `pings`: kernel arrival times
    (CLOCK_REALTIME seconds, as the daemon's log lines), appended by the
    reader thread only; `stopping`: the arrival of its STOPPING=1, or None;
    both read after close()."""

    def __init__(self, name):
        self.path = os.path.join("/tmp", name + ".notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        # The kernel queues 512 datagrams (net.unix.max_dgram_qlen): 51 s
        # of pings should the reader not get the CPU; the daemon never
        # waits for room (MSG_DONTWAIT).
        self.sock.bind(self.path)
        os.chmod(self.path, 0o666)  # a daemon that drops to --runas USER sends too
        self.pings = []
        self.stopping = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._read, name="loop-watch", daemon=True)
        self._thread.start()

    def env(self):
        """What the daemon's environment gets (a path: abstract names stop
        at network namespaces, and tests run daemons in others)."""
        return {"NOTIFY_SOCKET": self.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)}

    def _receive(self):
        """Takes one datagram: a ping's or STOPPING=1's arrival time is
        kept, anything else ignored; raises BlockingIOError /
        socket.timeout when there is none."""
        data, anc, _, _ = self.sock.recvmsg(256, socket.CMSG_SPACE(16))
        t = time.time()
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS and len(raw) >= 16:
                sec, nsec = struct.unpack("qq", raw[:16])
                t = sec + nsec / 1e9
        fields = data.split(b"\n")
        if b"WATCHDOG=1" in fields:
            self.pings.append(t)
        if b"STOPPING=1" in fields and self.stopping is None:
            self.stopping = t

    def _read(self):
        self.sock.settimeout(0.05)
        while not self._closing.is_set():
            try:
                self._receive()
            except socket.timeout:
                continue
        self.sock.setblocking(False)
        while True:  # what came before close(): nothing is lost
            try:
                self._receive()
            except (BlockingIOError, InterruptedError):
                break

    def close(self):
        self._closing.set()
        self._thread.join()
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def worst_gap(self, until=None):
        """(seconds, start, end) of the longest silence between the first
        ping and STOPPING=1, or `until` (the daemon's end) without one, or
        the last ping if that is None too; None with no ping."""
        until = self.stopping or until
        times = sorted(t for t in self.pings if t <= until) if until else sorted(self.pings)
        times += [until] if until and times else []
        gaps = [(b - a, a, b) for a, b in zip(times, times[1:])]
        return max(gaps) if gaps else None


def _ending(gap, watch, until):
    """How the message names a gap's end: STOPPING=1 or the daemon's exit
    ends the last."""
    if watch.stopping and gap[2] == watch.stopping:
        return " (when it said STOPPING=1: quit or a signal reached its loop that late)"
    return " (when it ended: it never said STOPPING=1)" if gap[2] == until else ""


def _stamp(t):
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _line_time(line):
    """A qmigd log line's time ("2026-01-02 03:04:05.678 qmigd ..."), or None."""
    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def log_window(text, start, end, limit=40):
    """The log lines from the last one before `start` to `end`: what the
    daemon was doing when its loop went silent, and what it did next."""
    lines = text.splitlines()
    first, last = 0, len(lines)
    for i, line in enumerate(lines):
        t = _line_time(line)
        if t is None:
            continue
        if t <= start:
            first = i
        if t > end + 0.2:
            last = i
            break
    window = lines[first:last]
    if len(window) > limit:
        window = window[:limit // 2] + [f"... {len(window) - limit} lines ..."] + window[-limit // 2:]
    return "\n".join("    " + l for l in window) or "    (no log lines then)"


def stall_message(who, gap, watch, until, log_path, log_text):
    secs, start, end = gap
    return (f"{who}: its loop thread was silent for {secs:.2f} s (no WATCHDOG=1, one due "
            f"every {WATCHDOG_USEC / 2e6:.2f} s), from {_stamp(start)} to {_stamp(end)}"
            f"{_ending(gap, watch, until)}; its log {log_path} then:\n"
            f"{log_window(log_text, start, end)}")


def record(log_dir, who, gap, pings):
    """One line per daemon in LOG_DIR/loop-gaps.txt: the suite's gaps,
    measured (docs/testing.md)."""
    try:
        with open(os.path.join(log_dir, "loop-gaps.txt"), "a") as f:
            at = f" at {_stamp(gap[1])}" if gap else ""
            f.write(f"{who} pings={pings} max_gap={gap[0] if gap else 0:.3f}{at}\n")
    except OSError:
        pass
