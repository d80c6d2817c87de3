"""Waiting for an event, never for a time.

A test that needs something to have happened (a status, a log line, a
file, a process gone) asks for it with wait_until: the probe is polled
until it answers, and the deadline only guards against a hang. On
timeout the error says what was awaited and what the probe saw last, so
a red run reads as "waited 60 s for X; saw Y", not as a bare assertion.

Deadlines are generous (tens of seconds): the suite runs several tests
side by side on a 2-core machine, under sanitizers, beside a CPU hog in
the flake hunt. A test asserts a short duration only where a latency is
its subject, and says so where it does.
"""
import os
import time

# The default hang guard, in seconds.
DEADLINE = 60.0
# How often a probe is polled: cheap probes (a stat, a QMP query) only.
EVERY = 0.02


class WaitTimeout(AssertionError, TimeoutError):
    """A wait_until that ran out: an AssertionError, so a test fails (and
    a TimeoutError, for the scripts that wait on a migration)."""


def wait_until(what, probe, timeout=DEADLINE, every=EVERY, seen=None):
    """Polls probe() until it returns something truthy, and returns that.
    `what` names the awaited event for the error; `seen()` (default: the
    probe's last answer) says what there was instead. A probe that raises
    fails the wait at once: the error is the test's."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            shown = seen() if seen else got
            raise WaitTimeout(f"waited {timeout:g} s for {what}; saw {shown!r}")
        time.sleep(every)


def wait_file(path, timeout=DEADLINE, nonempty=False):
    """Waits until `path` exists (and holds a byte, with nonempty)."""
    def there():
        try:
            return os.path.getsize(path) > 0 if nonempty else os.path.lexists(path)
        except OSError:
            return False
    wait_until(f"{path} to appear" + (" with data" if nonempty else ""), there, timeout,
               seen=lambda: "nothing")


def wait_text(read, text, count=1, timeout=DEADLINE, where="the log"):
    """Waits until read() (a log's text) holds `text` at least `count` times."""
    def found():
        return read().count(text) >= count
    wait_until(f"{count}x {text!r} in {where}", found, timeout,
               seen=lambda: f"{read().count(text)}x; its end: {read()[-600:]}")


def pid_gone(pid):
    """True once no process `pid` is there, or it is a zombie (ended,
    not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def task_state(pid, tid=None):
    """The state letter of a process or one of its threads (R, S, D, T...)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()[0]


class TcpSocket(tuple):
    """One IPv4 TCP socket of /proc/net/tcp: (lport, rport, state, rx_queue,
    inode). state is the kernel's hex code ("01" ESTABLISHED, "02"
    SYN_SENT, "0A" LISTEN); rx_queue is the bytes its owner has not read
    (a listener's: its accept queue's length)."""
    lport = property(lambda s: s[0])
    rport = property(lambda s: s[1])
    state = property(lambda s: s[2])
    rx_queue = property(lambda s: s[3])
    inode = property(lambda s: s[4])

    LISTEN, ESTABLISHED, SYN_SENT = "0A", "01", "02"


def tcp_sockets():
    """Every IPv4 TCP socket of this network namespace, as TcpSockets: what
    a test reads to know that a daemon has accepted, read or sent
    something, or has a connection under way."""
    with open("/proc/net/tcp") as f:
        lines = f.read().splitlines()[1:]
    for line in lines:
        v = line.split()
        yield TcpSocket((int(v[1].split(":")[1], 16), int(v[2].split(":")[1], 16), v[3],
                         int(v[4].split(":")[1], 16), int(v[9])))


def accept_queue(port):
    """Connections waiting in the accept queue of the listener on `port`."""
    return sum(s.rx_queue for s in tcp_sockets() if s.state == TcpSocket.LISTEN and s.lport == port)
