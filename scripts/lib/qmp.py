"""Minimal QMP client (Python standard library only).

Speaks to QEMU 10 and to qmigd alike: greeting, qmp_capabilities,
execute with id, events kept in a queue.
"""
import json
import os
import shutil
import socket
import subprocess
import struct
import time

from waiting import wait_until, WaitTimeout


class QMPError(Exception):
    def __init__(self, cls, desc):
        super().__init__(f"{cls}: {desc}")
        self.cls = cls
        self.desc = desc


class NotQMP(ConnectionError):
    """The peer on the socket does not speak QMP (an HMP monitor, a stream
    of bytes): its first words, or how much it sent without a line end."""


# The longest line a monitor sends: QEMU 10's query-qmp-schema is ~0.2 MiB;
# its greeting, ~150 bytes.
MAX_LINE = 16 << 20
MAX_GREETING = 64 << 10


class QMP:
    def __init__(self, path, timeout=30.0, negotiate=True, startup=None):
        """`startup`, if longer than `timeout`: how long the greeting and
        qmp_capabilities may take, a process starting on a busy machine
        (QEMU runs the commands only once it has made the machine)."""
        self.path = path
        startup = max(timeout, startup or 0)
        refused = []

        def connected():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                return s
            except OSError as e:
                s.close()
                refused[:] = [e]
                return None
        try:
            self.sock = wait_until(f"{path} to take a connection", connected, startup,
                                   seen=lambda: refused[0])
        except WaitTimeout:
            # The connect's own error: callers tell a missing socket from
            # one nobody listens on by it (migrate_run.connect_monitor).
            raise refused[0] from None
        self.sock.settimeout(startup)
        self.buf = b""
        self.events = []
        self.next_id = 1
        self.greeting = self._read(MAX_GREETING)
        if not isinstance(self.greeting, dict) or "QMP" not in self.greeting:
            raise NotQMP(f"{path} is not a QMP monitor: its greeting was "
                         f"{json.dumps(self.greeting)[:80]}")
        if negotiate:
            self.cmd("qmp_capabilities")
        self.sock.settimeout(timeout)

    def peer_threads(self):
        """What the process on the other end is doing, thread by thread
        (name, state, kernel wait channel, syscall): said when it does not
        answer in time, so that a stall in CI names its cause."""
        try:
            cred = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
            pid = struct.unpack("3i", cred)[0]
            out = []
            for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
                t = f"/proc/{pid}/task/{tid}"
                def part(name):
                    try:
                        with open(f"{t}/{name}") as f:
                            return f.read().strip()
                    except OSError:
                        return "?"
                stat = part("stat")
                state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"
                out.append(f"{tid} {part('comm')} {state} wchan={part('wchan')} "
                           f"syscall={part('syscall').split(' ')[0]}")
            return f"pid {pid}: " + "; ".join(out) + self._queues(pid) + _backtraces(pid)
        except OSError as e:
            return f"peer unknown ({e})"

    def _queues(self, pid):
        """The bytes waiting in each of the peer's unix sockets (ss -x): a
        request still in its receive queue was never read."""
        try:
            out = subprocess.run(["ss", "-xnp"], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
        mine = [" ".join(l.split()[:7]) for l in out.splitlines() if f"pid={pid}," in l]
        return "; its unix sockets (state recv-q send-q local peer): " + " | ".join(mine)

    def _read(self, max_line=None):
        """The next message. The socket's timeout bounds the whole message,
        not each recv (a peer that sends a byte at a time cannot hold the
        reader); a line longer than max_line (MAX_LINE) is not QMP."""
        max_line = max_line or MAX_LINE
        limit = self.sock.gettimeout()
        deadline = None if limit is None else time.monotonic() + limit
        scanned = 0
        try:
            while b"\n" not in self.buf[scanned:]:
                scanned = len(self.buf)
                if scanned > max_line:
                    raise NotQMP(f"{self.path} sent {scanned} bytes without a line end: "
                                 f"not a QMP monitor")
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise socket.timeout
                    self.sock.settimeout(left)
                try:
                    chunk = self.sock.recv(1 << 20)
                except socket.timeout:
                    raise TimeoutError(f"QMP socket {self.path}: no answer in {limit} s; "
                                       f"{self.peer_threads()}") from None
                if not chunk:
                    raise ConnectionError(f"QMP socket {self.path} closed")
                self.buf += chunk
        finally:
            self.sock.settimeout(limit)
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            raise NotQMP(f"{self.path} is not a QMP monitor: it said {line[:80]!r}") from None

    def send_raw(self, text):
        self.sock.sendall(text.encode() if isinstance(text, str) else text)

    def read_reply(self):
        """Next non-event message."""
        while True:
            msg = self._read()
            if "event" in msg:
                self.events.append(msg)
                continue
            return msg

    def execute(self, name, args=None, fd=None, **kw):
        """Returns the whole reply dict ({"return":..} or {"error":..}).
        fd: a descriptor sent with the request (SCM_RIGHTS), as for getfd."""
        req = {"execute": name, "id": self.next_id}
        self.next_id += 1
        if args is None:
            args = {}
        args.update(kw)
        if args:
            req["arguments"] = args
        data = (json.dumps(req) + "\n").encode()
        if fd is None:
            self.send_raw(data)
        else:
            socket.send_fds(self.sock, [data], [fd])
        while True:
            reply = self.read_reply()
            if reply.get("id") == req["id"]:
                return reply

    def cmd(self, name, args=None, fd=None, **kw):
        reply = self.execute(name, args, fd, **kw)
        if "error" in reply:
            raise QMPError(reply["error"]["class"], reply["error"]["desc"])
        return reply["return"]

    def execute_within(self, seconds, name, args=None):
        """execute(), its answer waited for `seconds` at most (then a
        TimeoutError): what a Ctrl-C sends, which must act at once."""
        saved = self.sock.gettimeout()
        self.sock.settimeout(seconds)
        try:
            return self.execute(name, args)
        finally:
            self.sock.settimeout(saved)

    def hmp(self, line):
        return self.cmd("human-monitor-command", {"command-line": line})

    def poll_events(self, timeout=0.0):
        self.sock.settimeout(max(timeout, 0.001))
        try:
            while True:
                if b"\n" not in self.buf:
                    chunk = self.sock.recv(65536)
                    if not chunk:
                        break
                    self.buf += chunk
                msg = self._read()
                if "event" in msg:
                    self.events.append(msg)
        except (socket.timeout, BlockingIOError):
            pass
        finally:
            self.sock.settimeout(30.0)
        return self.events

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def _backtraces(pid):
    """Every thread's stack of a silent peer, where gdb is installed."""
    if not shutil.which("gdb"):
        return ""
    try:
        r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    frames = [l for l in r.stdout.splitlines() if l.startswith(("#", "Thread "))]
    return "\nits threads' stacks (gdb):\n" + "\n".join(frames[:200])
