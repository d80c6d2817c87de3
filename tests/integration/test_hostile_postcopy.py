#!/usr/bin/env python3
"""Hostile peers of postcopy and the return path (issue 32): every wait on
the return path ends when its reader ends, however it ends; no write to a
peer that stops reading holds cancel or quit; an error on the preempt
channel during postcopy pauses (a link cut half-way through a page, a
stranger in the preempt slot during a recovery) instead of failing; a
RESUME_ACK outside a recovery is dropped, as a QEMU 10 source drops it;
pages that came on the preempt channel are in the received bitmap a
recovery sends; and a destination reads a preempt channel its source sends
on to the end marker, so a page still on a slow link (a delaying proxy) is
not lost.
Fake peers speak the wire format by hand (wire.py). A hang is a timeout
here, and `quit` must end a daemon within seconds whatever its peer does."""
import array
import contextlib
import fcntl
import os
import platform
import select
import socket
import struct
import subprocess
import termios
import threading
import time

import wire
from itest import test, main, check
from fixtures import MiB
from runner import (Peer, make_image, remove, unique_name, wait_status, start_incoming, free_port,
                    SANITIZED)
from waiting import wait_until, wait_text, DEADLINE, tcp_sockets

SIZE = 4 * MiB
PC = [{"capability": "postcopy-ram", "state": True}]
PREEMPT = [{"capability": "postcopy-preempt", "state": True}]
RP = [{"capability": "return-path", "state": True}]
# Latency bounds. A quit that hung would wait for ever or for a link
# timeout (30 s by default): 5 s tells them apart with room to spare, and
# a sanitizer build gets twice that.
QUIT_SECS = 10 if SANITIZED else 5
# A wait that a writer blocked until the 30 s link timeout would outlast.
BELOW_LINK_TIMEOUT = 20
# System call numbers (/proc/PID/task/TID/syscall) of the suite's machines.
CALLS = {"x86_64": {"write": 1, "writev": 20, "sendto": 44, "sendmsg": 46, "futex": 202},
         "aarch64": {"write": 64, "writev": 66, "sendto": 206, "sendmsg": 211, "futex": 98}
         }[platform.machine()]
SENDS = {CALLS[n] for n in ("write", "writev", "sendto", "sendmsg")}
FUTEX_WAIT_BITSET = 9  # what a condition variable's wait is (FUTEX_WAIT, 0, a mutex's)


@contextlib.contextmanager
def daemon(role, tag, content="sparse", extra=None, kind="qmigd"):
    path = f"/dev/shm/{unique_name(tag)}.ram"
    make_image(path, SIZE, content)
    p = Peer(kind, role, [("mem", path, SIZE)], tag, extra=extra)
    try:
        p.image = path
        yield p
    finally:
        p.stop()
        remove(path)


def quits_in_time(peer):
    """`quit` ends the daemon within QUIT_SECS (it is killed otherwise)."""
    try:
        peer.qmp.execute("quit")
    except Exception:
        pass
    try:
        peer.proc.wait(timeout=QUIT_SECS)
        return True
    except subprocess.TimeoutExpired:
        return False


def wait_log(peer, text, count=1):
    wait_text(peer.log_text, text, count, where=f"the {peer.role}'s log")


def sleeping_calls(pid):
    """{tid: (thread name, [system call number, its arguments...])} of the
    threads of `pid` asleep in a system call (/proc says "running" of the
    others)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                v = f.read().split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if v and v[0].isdigit():
            out[tid] = (name, [int(v[0])] + [int(a, 16) for a in v[1:7]])
    return out


def socket_inode(pid, fd):
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return int(link[8:-1]) if link.startswith("socket:[") else None


def blocked_sending(pid, inode=None):
    """Whether a thread of `pid` is blocked sending on a socket (the one
    of `inode`, if given): a writer whose peer stopped reading."""
    for _, call in sleeping_calls(pid).values():
        if call[0] in SENDS:
            got = socket_inode(pid, call[1])
            if got is not None and inode in (None, got):
                return True
    return False


def tcp_socket(lport, rport):
    """(inode, rx_queue: bytes its owner has not read) of the IPv4 TCP
    socket from `lport` to `rport`, or None (/proc/net/tcp)."""
    for s in tcp_sockets():
        if (s.lport, s.rport) == (lport, rport):
            return s.inode, s.rx_queue
    return None


def page_of(path, index):
    with open(path, "rb") as f:
        f.seek(index * wire.PAGE)
        return f.read(wire.PAGE)


class Listener:
    """Accepts one connection and hands it to serve(conn) on a thread."""

    def __init__(self, serve):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(30)
        self.port = self.srv.getsockname()[1]
        self.serve = serve
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        try:
            c, _ = self.srv.accept()
        except OSError:
            return
        try:
            self.serve(c)
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self.srv.close()
        self.thread.join(timeout=30)


def read_until(c, marker, timeout=30):
    c.settimeout(timeout)
    seen = b""
    while marker not in seen:
        chunk = c.recv(1 << 16)
        if not chunk:
            raise EOFError(f"closed before {marker!r}")
        seen += chunk


def drain(c, until=None):
    """Reads until EOF, or until the event `until` is set."""
    c.settimeout(0.1)
    while not (until and until.is_set()):
        try:
            if not c.recv(1 << 16):
                return
        except socket.timeout:
            pass


# --- 1. a resume whose destination ends the return path cleanly ----------

@test
def test_resume_ends_when_the_return_path_ends():
    """A destination that answers the resume's RECV_BITMAP with SHUT(0)
    ends the source's reader cleanly: the resume fails and the source is
    postcopy-paused again (not postcopy-recover for ever), and quits."""
    with daemon("source", "hp-src", content="random") as s:
        s.qmp.cmd("migrate-set-capabilities", capabilities=PC)
        s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 1 * MiB,
                                             "max-postcopy-bandwidth": 1 * MiB})
        cut = threading.Event()
        first = Listener(lambda c: (drain(c, cut), c.shutdown(socket.SHUT_RDWR)))

        def shut_at_resume(c):
            read_until(c, b"\x08" + struct.pack(">H", wire.CMD_RECV_BITMAP))
            c.sendall(wire.rp_message(wire.RP_SHUT, wire.be32(0)))
            drain(c)
        second = Listener(shut_at_resume)
        try:
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{first.port}")
            s.qmp.cmd("migrate-start-postcopy")
            wait_status(s, ("postcopy-active",), timeout=60)
            cut.set()
            wait_status(s, ("postcopy-paused",), timeout=60, fail_on=("failed", "completed"))
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{second.port}", resume=True)
            # Not postcopy-recover until the 30 s link timeout.
            si = wait_status(s, ("postcopy-paused",), timeout=BELOW_LINK_TIMEOUT,
                             fail_on=("failed", "completed", "postcopy-active"))
            check("return path ended before" in si.get("error-desc", ""), si)
            check(quits_in_time(s), "quit hung after the resume")
            print(f"  paused again: {si['error-desc']!r}")
        finally:
            first.close()
            second.close()


# --- 2. a source that never reads its return path --------------------------

def flood_pings(connect, pid):
    """A source that opens the return path and PINGs without reading a
    PONG; returns its socket once the destination (process `pid`) stopped
    reading: a thread of it is blocked writing PONGs. (Our receive buffer
    keeps its default size: over TCP a tiny one drops the destination's
    segments, and the link then stalls in retransmission backoff before
    the destination's send buffer is full, its reader waiting in recv.)"""
    c = connect()
    c.sendall(wire.header() + wire.config() + wire.command(wire.CMD_OPEN_RETURN_PATH))
    chunk = wire.command(wire.CMD_PING, wire.be32(1)) * 4096
    c.setblocking(False)
    sent = 0
    deadline = time.monotonic() + DEADLINE
    while sent < 72 << 20:
        try:
            sent += c.send(chunk[sent % len(chunk):])  # whole PINGs: the stream goes on
            continue
        except BlockingIOError:
            pass
        if blocked_sending(pid):
            c.setblocking(True)
            return c
        check(time.monotonic() < deadline,
              f"{sent} bytes of PINGs sent, and no destination thread blocked writing: "
              f"{sleeping_calls(pid)}")
        select.select([], [c], [], 0.05)  # room again, or the next look
    c.close()
    raise AssertionError("the destination read every PING: it never blocked on the PONGs")


def unix_connector(path):
    def connect():
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        return c
    return connect


@test
def test_cancel_while_the_source_never_reads():
    """unix: (no dead-link timeout there): the load thread blocked writing
    PONGs does not keep migrate_cancel from ending the migration
    (`cancelled` within seconds), and the daemon then quits at once."""
    path = f"/tmp/{unique_name('hp-rp')}.sock"
    with daemon("dest", "hp-dst") as d:
        d.qmp.cmd("migrate-incoming", uri=f"unix:{path}")
        c = flood_pings(unix_connector(path), d.proc.pid)
        try:
            check(d.status()["status"] == "active", d.status())
            d.qmp.cmd("migrate_cancel")
            # unix: has no link timeout: a cancel held by the writer would never end.
            wait_status(d, ("cancelled",), timeout=60, fail_on=("failed",))
            check(quits_in_time(d), "quit hung after the cancel")
        finally:
            c.close()
            remove(path)


@test
def test_quit_while_the_source_never_reads():
    """tcp: with --link-timeout 0: `quit` ends the daemon while its load
    thread is blocked writing PONGs to a source that never reads."""
    with daemon("dest", "hp-dst", extra=["--link-timeout", "0"]) as d:
        port = start_incoming(d)
        c = flood_pings(lambda: socket.create_connection(("127.0.0.1", port)), d.proc.pid)
        try:
            check(d.status()["status"] == "active", d.status())
            check(quits_in_time(d), "quit hung while the return path was blocked")
        finally:
            c.close()


class PreemptNeverRead:
    """A postcopy destination that drains the main channel, asks for every
    page once the package is in, and never reads the preempt channel."""

    def __init__(self, pages):
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)
        self.srv.settimeout(30)
        self.port, self.pages, self.conns = self.srv.getsockname()[1], pages, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        try:
            m, _ = self.srv.accept()
            self.conns.append(m)
            read_until(m, wire.command(wire.CMD_PACKAGED, wire.be32(0))[:5])
            self.conns.append(self.srv.accept()[0])  # the preempt channel, never read
            asks = struct.pack(">HHQIB", 3, 16, 0, wire.PAGE, 3) + b"mem"
            asks += b"".join(struct.pack(">HHQI", 4, 12, i * wire.PAGE, wire.PAGE)
                             for i in range(1, self.pages))
            m.sendall(asks)
            drain(m, self.stop)
        except OSError:
            pass

    def queued(self):
        buf = array.array("i", [0])
        fcntl.ioctl(self.conns[1], termios.FIONREAD, buf)
        return buf[0]

    def wait_stalled(self, pid):
        """Until the source `pid` is blocked writing pages on the preempt
        channel (its buffers and ours full)."""
        def stalled():
            if len(self.conns) < 2:
                return False
            theirs = tcp_socket(self.conns[1].getpeername()[1], self.port)
            return theirs is not None and blocked_sending(pid, theirs[0])
        wait_until("the source to block writing on the preempt channel", stalled,
                   seen=lambda: f"{self.queued() if len(self.conns) > 1 else 0} bytes queued")

    def close(self):
        self.stop.set()
        self.srv.close()
        self.thread.join(timeout=30)
        for c in self.conns:
            c.close()


@test
def test_source_blocked_on_the_preempt_channel_pauses_and_quits():
    """A qmigd source whose destination asks for every page and never
    reads the preempt channel: migrate-pause pauses it (the preempt
    channel is shut down with the main one), and quit ends it."""
    size = 32 * MiB
    path = f"/dev/shm/{unique_name('hp-src')}.ram"
    make_image(path, size, "random")
    s = Peer("qmigd", "source", [("mem", path, size)], "hp-src")
    fake = PreemptNeverRead(size // wire.PAGE)
    try:
        s.qmp.cmd("migrate-set-capabilities", capabilities=PC + PREEMPT)
        s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 1 * MiB,
                                             "max-postcopy-bandwidth": 1 * MiB})
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{fake.port}")
        s.qmp.cmd("migrate-start-postcopy")
        wait_status(s, ("postcopy-active",), timeout=60)
        # Requested pages go at once, whatever the bandwidth: the writer
        # blocks once the preempt channel's buffers are full.
        fake.wait_stalled(s.proc.pid)
        s.qmp.cmd("migrate-pause")
        # A latency bound: a pause held by the blocked writer would wait
        # for its link timeout.
        wait_status(s, ("postcopy-paused",), timeout=BELOW_LINK_TIMEOUT,
                    fail_on=("failed", "completed"))
        check(quits_in_time(s), "quit hung")
    finally:
        fake.close()
        s.stop()
        remove(path)


# --- 4. the preempt channel during postcopy --------------------------------

def postcopy_dest(d, preempt=True):
    """A fake source's postcopy into `d` up to the guest running there;
    returns (port, main channel)."""
    d.qmp.cmd("migrate-set-capabilities", capabilities=PC + (PREEMPT if preempt else []))
    port = start_incoming(d)
    m = socket.create_connection(("127.0.0.1", port))
    m.sendall(wire.postcopy_start(SIZE))
    wait_status(d, ("postcopy-active",), timeout=60)
    return port, m


def preempt_connect(d, port, count=1):
    p = socket.create_connection(("127.0.0.1", port))
    wait_log(d, "postcopy preempt channel connected", count=count)
    return p


@test
def test_link_cut_half_way_through_a_preempt_page_pauses():
    """Half a page on the preempt channel, then both channels cut: the
    destination pauses (postcopy-paused, as its source would), it does not
    fail; and it quits."""
    with daemon("dest", "hp-dst") as d:
        port, m = postcopy_dest(d)
        p = preempt_connect(d, port)
        p.sendall(wire.page(3 * wire.PAGE, b"\xab" * wire.PAGE)[:2000])
        p.close()
        m.close()
        wait_status(d, ("postcopy-paused",), timeout=BELOW_LINK_TIMEOUT,
                    fail_on=("failed", "completed", "cancelled"))
        check(quits_in_time(d), "quit hung while paused")


@test
def test_stranger_in_the_preempt_slot_pauses():
    """During a recovery, after the new main channel, a stranger takes the
    preempt slot and sends garbage: the destination pauses again (the
    real source recovers once more), it does not fail."""
    with daemon("dest", "hp-dst") as d:
        _, m = postcopy_dest(d)
        m.close()
        wait_status(d, ("postcopy-paused",), timeout=BELOW_LINK_TIMEOUT,
                    fail_on=("failed", "completed"))
        rport = free_port()
        d.qmp.cmd("migrate-recover", uri=f"tcp:127.0.0.1:{rport}")
        m2 = socket.create_connection(("127.0.0.1", rport))
        wait_status(d, ("postcopy-recover",), timeout=BELOW_LINK_TIMEOUT,
                    fail_on=("failed", "completed"))
        stranger = preempt_connect(d, rport)
        stranger.sendall(b"\xff" * 64)
        try:
            wait_status(d, ("postcopy-paused",), timeout=BELOW_LINK_TIMEOUT,
                        fail_on=("failed", "completed", "cancelled"))
        finally:
            stranger.close()
            m2.close()
        check("postcopy preempt channel: " in d.log_text(), "the preempt error is not logged")
        check(quits_in_time(d), "quit hung while paused")


# --- 5. RESUME_ACK, the received bitmap, the preempt channel's end ----------

@test
def test_resume_ack_outside_a_recovery_is_ignored():
    """Two RESUME_ACKs during precopy, then SHUT(0): a QEMU 10 source
    ignores them and completes; so does a qmigd source, with return-path
    and with postcopy-ram."""
    acks = wire.rp_message(wire.RP_RESUME_ACK, wire.be32(1)) * 2
    shut = wire.rp_message(wire.RP_SHUT, wire.be32(0))
    for kind in ("qemu", "qmigd"):
        for caps in (RP, PC):
            with daemon("source", "hp-ack", content="mixed", kind=kind) as s:
                s.qmp.cmd("migrate-set-capabilities", capabilities=caps)

                def serve(c):
                    read_until(c, wire.command(wire.CMD_OPEN_RETURN_PATH))
                    c.sendall(acks + shut)
                    drain(c)
                fake = Listener(serve)
                try:
                    s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{fake.port}")
                    si = wait_status(s, ("completed", "failed"), timeout=30, fail_on=())
                finally:
                    fake.close()
                check(si["status"] == "completed",
                      f"{kind} {caps[0]['capability']}: {si.get('error-desc')}")
    print("  QEMU 10 and qmigd sources complete with both")


def read_recv_bitmap(c):
    """The destination's RECV_BITMAP answer: its bitmap as an int."""
    c.settimeout(10)
    buf = b""

    def take(n):
        nonlocal buf
        while len(buf) < n:
            chunk = c.recv(1 << 16)
            check(chunk, "the return path closed before RECV_BITMAP")
            buf += chunk
        out, buf = buf[:n], buf[n:]
        return out
    while True:
        type_, length = struct.unpack(">HH", take(4))
        payload = take(length)
        if type_ == wire.RP_RECV_BITMAP:
            break
    check(payload == wire.cstr8("mem"), payload)
    size = struct.unpack(">Q", take(8))[0]
    bits = int.from_bytes(take(size), "little")
    take(8)  # the end mark
    return bits


@test
def test_preempt_pages_are_in_the_received_bitmap():
    """A page that came on the preempt channel before the main channel
    broke is in the image and in the bitmap the recovery sends back, so
    the resumed source does not send it again."""
    with daemon("dest", "hp-dst") as d:
        port, m = postcopy_dest(d)
        p = preempt_connect(d, port)
        # Page 9 not next to page 5: the reader writes page 5 out when it comes.
        p.sendall(wire.page(5 * wire.PAGE, b"\xcd" * wire.PAGE) +
                  wire.page(9 * wire.PAGE, b"\xcd" * wire.PAGE) + wire.flag(wire.EOS))
        wait_until("the preempt page in the image",
                   lambda: page_of(d.image, 5) == b"\xcd" * wire.PAGE)
        m.close()  # the main channel breaks
        wait_status(d, ("postcopy-paused",), timeout=BELOW_LINK_TIMEOUT,
                    fail_on=("failed", "completed"))
        rport = free_port()
        d.qmp.cmd("migrate-recover", uri=f"tcp:127.0.0.1:{rport}")
        m2 = socket.create_connection(("127.0.0.1", rport))
        try:
            m2.sendall(wire.command(wire.CMD_RECV_BITMAP, wire.cstr8("mem")))
            bits = read_recv_bitmap(m2)
        finally:
            m2.close()
            p.close()
        check(bits & (1 << 5) and bits & (1 << 9),
              f"pages 5 and 9 are not in the received bitmap ({bits:#x})")


def delay_proxy(port, delay):
    """A slow link (this kernel has no netem): a Listener that forwards its
    connection to `port`, each chunk `delay` seconds after it came, and its
    end too. Its `forwarded` is set once the first chunk went on."""
    forwarded = threading.Event()

    def forward(a):
        with socket.create_connection(("127.0.0.1", port)) as b:
            while True:
                chunk = a.recv(1 << 16)
                time.sleep(delay)
                if not chunk:
                    b.shutdown(socket.SHUT_WR)
                    drain(b)
                    return
                b.sendall(chunk)
                forwarded.set()
    proxy = Listener(forward)
    proxy.forwarded = forwarded
    return proxy


@test
def test_no_preempt_page_in_flight_is_lost():
    """A source that sends pages on a preempt channel 0.5 s slower than the
    main channel: its second page and the end marker are still on the link
    when the main channel ends; the destination reads the preempt channel
    to the marker before it completes, so both pages are there."""
    page = {7: b"\xef" * wire.PAGE, 11: b"\x5a" * wire.PAGE}
    with daemon("dest", "hp-dst") as d:
        port, m = postcopy_dest(d)
        proxy = delay_proxy(port, 0.5)
        p = socket.create_connection(("127.0.0.1", proxy.port))
        try:
            wait_log(d, "postcopy preempt channel connected")
            p.sendall(wire.page(7 * wire.PAGE, page[7]))
            check(proxy.forwarded.wait(60), "the proxy forwarded nothing")
            p.sendall(wire.page(11 * wire.PAGE, page[11]) + wire.flag(wire.EOS))
            m.sendall(wire.end() + wire.flag(wire.EOS) + wire.footer() + b"\x00")
            t0 = time.monotonic()
            di = wait_status(d, ("completed",), timeout=30)
            took = time.monotonic() - t0
        finally:
            p.close()
            m.close()
            proxy.close()
        for i, data in page.items():
            check(page_of(d.image, i) == data, f"page {i} on the slow link was lost")
        print(f"  completed {took:.2f} s after the main channel's end, "
              f"{di['incoming']['normal']} page(s)")


# --- migrate_cancel refused at a destination in postcopy --------------------

@test
def test_destination_refuses_cancel_in_postcopy():
    """Once postcopy runs, the guest's pages are split between the two sides:
    a destination refuses migrate_cancel (QMP and HMP) as QEMU's
    qmp_migrate_cancel does, active or paused, and stays where it was."""
    refusal = "Postcopy migration in progress, cannot cancel."
    for state in ("postcopy-active", "postcopy-paused"):
        with daemon("dest", "hp-dcan") as d:
            port, m = postcopy_dest(d, preempt=False)
            if state == "postcopy-paused":
                m.close()
                wait_status(d, (state,), timeout=BELOW_LINK_TIMEOUT,
                            fail_on=("failed", "completed", "cancelled"))
            r = d.qmp.execute("migrate_cancel")
            check(r.get("error", {}).get("desc") == refusal, f"{state}: migrate_cancel -> {r}")
            hmp = d.qmp.hmp("migrate_cancel")
            check(hmp == f"Error: {refusal}\r\n", f"{state}: HMP migrate_cancel -> {hmp!r}")
            check(d.status()["status"] == state, f"{state}: now {d.status()}")
            m.close()


# --- names off the wire in page requests ----------------------------------

@test
def test_page_request_block_name_is_escaped():
    """A destination asks REQ_PAGES_ID for a block whose name holds control
    bytes, invalid UTF-8 and a forged log line: the source fails, its
    error-desc names the block as printable ASCII (\\xNN for the rest)."""
    name = b"m\x01e\xff\n<0>emerg: x\x1b[2J"

    def serve(c):
        read_until(c, wire.command(wire.CMD_PACKAGED, wire.be32(0))[:5])
        c.sendall(struct.pack(">HHQIB", 3, 13 + len(name), 0, wire.PAGE, len(name)) + name)
        drain(c)

    with daemon("source", "hp-rqname", "random") as s:
        fake = Listener(serve)
        try:
            s.qmp.cmd("migrate-set-capabilities", capabilities=PC)
            s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 1 * MiB})
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{fake.port}")
            s.qmp.cmd("migrate-start-postcopy")
            desc = wait_status(s, ("failed",), timeout=20, fail_on=("completed",)).get("error-desc", "")
        finally:
            fake.close()
        want = "MIG_RP_MSG_REQ_PAGES has no block 'm\\x01e\\xff\\x0a<0>emerg: x\\x1b[2J'"
        check(want in desc, repr(desc))
        check(all(" " <= ch < "\x7f" for ch in desc), repr(desc))


# --- migrate-pause while waiting for the preempt channel's end marker -----

@test
def test_pause_while_waiting_for_the_preempt_end_marker():
    """A source sends a page on the preempt channel, never its end marker,
    and ends the main stream: the destination waits for the marker (for ever
    with --link-timeout 0). migrate-pause ends that wait: postcopy-paused
    within seconds, still paused once the link timeout is past, and quit."""
    for timeout_ms in (0, 1500):
        with daemon("dest", "hp-nomark", extra=["--link-timeout", str(timeout_ms)]) as d:
            port, m = postcopy_dest(d)
            p = preempt_connect(d, port)
            p.sendall(wire.page(7 * wire.PAGE, b"\xef" * wire.PAGE))
            m.sendall(wire.end() + wire.flag(wire.EOS) + wire.footer() + b"\x00")
            wait_until("the destination to wait for the end marker",
                       lambda: waits_for_the_end_marker(d, port, m),
                       seen=lambda: sleeping_calls(d.proc.pid))
            check(d.status()["status"] == "postcopy-active", d.status())
            d.qmp.cmd("migrate-pause")
            wait_status(d, ("postcopy-paused",), timeout=60,
                        fail_on=("failed", "completed", "cancelled"))
            # The pause ended the wait (a link timeout says otherwise).
            wait_log(d, "paused while waiting for the postcopy preempt channel's end marker")
            if timeout_ms:
                # Nothing is to happen at the link timeout, nothing marks it:
                # pacing past it, then the state must be unchanged.
                time.sleep(timeout_ms / 1000 + 0.5)
            check(d.status()["status"] == "postcopy-paused", d.status())
            check(quits_in_time(d), f"quit hung (link timeout {timeout_ms} ms)")
            p.close()
            m.close()


def waits_for_the_end_marker(d, port, m):
    """Whether the destination has read the main stream to its end (all
    we sent is read) and its main load thread sleeps on a condition
    variable (end_preempt()'s wait for the preempt reader)."""
    ours = tcp_socket(port, m.getsockname()[1])
    if ours is None or ours[1]:
        return False
    return any(name == "mig/dst/main" and call[0] == CALLS["futex"]
               and call[2] & 0x7f == FUTEX_WAIT_BITSET
               for name, call in sleeping_calls(d.proc.pid).values())


if __name__ == "__main__":
    main()
