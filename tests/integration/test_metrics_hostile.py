#!/usr/bin/env python3
"""--metrics against strangers: whoever reaches the port may be hostile.
One endless header line does not grow the daemon; clients sending a byte
a second do not stop scrapes, and a pile of idle connections does not
take its descriptors; SIGTERM and quit end at once whatever clients
are connected; and 500 hostile connections (a byte a second, endless
header lines, idle, a Range of 1,600 parts) beside a running 256 MiB
migration: the migration completes, a well-behaved scraper is answered
throughout, the daemon's memory and descriptors stay bounded (the peaks
are printed), and it shuts down at once with them still open.

Latency bounds here are halves of the clients' 5 s deadline: what a
daemon that waited for a hostile client would take. The times are the
kernel's where they can be (when a scrape's answer or a cut arrived), not
when this busy process got round to reading them."""
import os
import resource
import selectors
import signal
import socket
import struct
import threading
import time

from itest import test, main, check
from fixtures import images, MiB
from runner import Peer, proc_status, free_port, start_incoming, wait_status, files_equal
from waiting import wait_until, tcp_sockets, TcpSocket

# What the daemon allows (daemon/service/metrics_server.h).
CAP = 512
DEADLINE = 5.0
PROMPT = DEADLINE / 2
RANGE = "Range: bytes=" + ",".join(f"{i}-{i}" for i in range(1600))
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def scrape(port, timeout=30.0):
    """Seconds from a scrape's request sent to its answer's arrival (the
    kernel's stamp of its first bytes); raises if it was not answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sent = time.time()
        c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data, first = b"", None
        while True:
            chunk, anc, _, _ = c.recvmsg(1 << 16, socket.CMSG_SPACE(16))
            for level, kind, raw in anc:
                if first is None and level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    first = sec + nsec / 1e9
            if not chunk:
                break
            data += chunk
    check(data.startswith(b"HTTP/1.1 200") and b"qmigd_info" in data, data[:200])
    return (first or time.time()) - sent


def since_last_segment(s):
    """Seconds since the last segment (a FIN, for a cut connection) came
    on TCP socket `s` (tcp_info's last_ack_recv)."""
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("I", info, 8 + 4 * 9 + 12)[0] / 1000


def listener_caught_up(port, count):
    """Whether the daemon listening on `port` has accepted `count`
    connections and read all they sent (/proc/net/tcp: its accept queue
    and its sockets' receive queues are empty)."""
    rows = [s for s in tcp_sockets() if s.lport == port]
    conns = [s.rx_queue for s in rows if s.state == TcpSocket.ESTABLISHED]
    return (all(s.rx_queue == 0 for s in rows if s.state == TcpSocket.LISTEN)
            and len(conns) >= count and not any(conns))


class Figures:
    """The daemon's peaks, sampled: anonymous memory (what it allocated:
    its RAM image is shared memory) and descriptors."""

    def __init__(self, pid):
        self.pid, self.anon, self.fds = pid, 0, 0

    def anon_now(self):
        return int(proc_status(self.pid)["RssAnon"].split()[0]) << 10

    def hwm(self):
        return int(proc_status(self.pid)["VmHWM"].split()[0]) << 10

    def fds_now(self):
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def sample(self):
        try:
            self.anon = max(self.anon, self.anon_now())
            self.fds = max(self.fds, self.fds_now())
        except (OSError, KeyError):
            pass


class Flood:
    """Hostile connections to `ports`, `counts` of each kind, kept open (a
    connection the daemon closes is opened again) until close():
      slowloris  a request's first line, then a header byte a second
      endless    one header line, sent as fast as the daemon reads it
      idle       connects and sends nothing
      range      a whole request with a Range of 1,600 parts, then reads
    One thread, non-blocking sockets; step() does one round."""

    def __init__(self, ports, counts):
        self.sel = selectors.DefaultSelector()
        self.ports, self.counts = ports, counts
        # (kind, seconds it was open until the daemon's cut came, whether
        # it was of the first round)
        self.closed_by_daemon = []
        self.range_answer_max = 0
        self.opened = 0
        for kind, n in counts.items():
            for i in range(n):
                self.open(kind, ports[i % len(ports)], first=True)

    def open(self, kind, port, first=False):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        self.sel.register(s, selectors.EVENT_READ, {"kind": kind, "port": port, "t": time.monotonic(),
                                                    "sent": 0, "got": 0, "last": 0.0,
                                                    "first": first})
        self.opened += 1

    def send(self, s, data):
        try:
            return s.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            return -1

    def feed(self, s, c, now):
        kind = c["kind"]
        if kind == "slowloris":
            if c["sent"] == 0:
                c["sent"] = self.send(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            elif now - c["last"] >= 1.0:
                self.send(s, b"a")
                c["last"] = now
        elif kind == "endless":
            if c["sent"] == 0:
                c["sent"] = self.send(s, b"GET /metrics HTTP/1.1\r\nX-Endless: ")
            else:
                self.send(s, b"a" * 65536)
        elif kind == "range" and c["sent"] == 0:
            c["sent"] = self.send(s, f"GET /metrics HTTP/1.1\r\nHost: x\r\n{RANGE}\r\n\r\n".encode())

    def step(self, timeout=0.05):
        now = time.monotonic()
        for key in list(self.sel.get_map().values()):
            self.feed(key.fileobj, key.data, now)
        for key, _ in self.sel.select(timeout):
            s, c = key.fileobj, key.data
            try:
                data = s.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            c["got"] += len(data)
            if c["kind"] == "range":
                self.range_answer_max = max(self.range_answer_max, c["got"])
            if not data:  # the daemon closed it: open another
                try:
                    late = since_last_segment(s)
                except OSError:
                    late = 0.0
                self.closed_by_daemon.append((c["kind"], time.monotonic() - c["t"] - late,
                                              c["first"]))
                self.sel.unregister(s)
                s.close()
                self.open(c["kind"], c["port"])

    def cut(self, kinds, first=False):
        """Seconds each connection of `kinds` was open until cut."""
        return [t for k, t, f in self.closed_by_daemon if k in kinds and (f or not first)]

    def sent_first_lines(self):
        return all(c["sent"] > 0 for c in (k.data for k in self.sel.get_map().values())
                   if c["kind"] in ("slowloris", "endless", "range"))

    def open_count(self):
        return len(self.sel.get_map())

    def close(self):
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()


class Scraper:
    """A well-behaved client scraping every 100 ms on its own thread."""

    def __init__(self, ports):
        self.latencies, self.failures = [], []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(ports,), daemon=True)
        self.thread.start()

    def run(self, ports):
        while not self.stop_event.wait(0.1):
            for port in ports:
                try:
                    self.latencies.append(scrape(port))
                except Exception as e:
                    self.failures.append(repr(e))

    def stop(self):
        self.stop_event.set()
        self.thread.join()


def ended_within(peer, end, limit=PROMPT):
    """Seconds the daemon took to exit after end() (SIGTERM or quit): a
    latency test, as one that waited for its clients would take their
    deadline."""
    t = time.monotonic()
    end()
    try:
        peer.proc.wait(timeout=limit + 2)
    except Exception:
        pass
    took = time.monotonic() - t
    check(peer.proc.poll() is not None and took < limit,
          f"qmigd {peer.role} still running {took:.1f} s after being told to end")
    return took


def metrics_peer(img, size, role="source", tag="mh"):
    port = free_port()
    return Peer("qmigd", role, [("mem", img, size)], tag, ["--metrics", f"127.0.0.1:{port}"]), port


@test
def test_endless_header_line_does_not_grow_the_daemon():
    """64 MiB of one header line: the daemon cuts the connection after a
    few KiB and its memory does not follow (cpp-httplib grew ~1 MiB per MiB)."""
    with images(MiB, "zero") as imgs:
        p, port = metrics_peer(imgs[0][1], MiB)
        try:
            fig = Figures(p.proc.pid)
            before = fig.anon_now()
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            sent = 0
            try:
                s.sendall(b"GET /metrics HTTP/1.1\r\nX-Endless: ")
                while sent < 64 * MiB:
                    s.sendall(b"a" * MiB)
                    sent += MiB
                    fig.sample()
            except OSError:
                pass  # cut: what should happen
            finally:
                s.close()
            fig.sample()
            grew = fig.anon - before
            print(f"  cut after {sent / MiB:.0f} MiB sent; anonymous memory grew {grew / MiB:.1f} MiB")
            check(sent < 64 * MiB, "the daemon read 64 MiB of one header line")
            check(grew < 4 * MiB, f"grew {grew / MiB:.1f} MiB")
            scrape(port)
        finally:
            p.stop()


@test
def test_slow_and_idle_clients_hold_nothing():
    """Two clients sending a byte a second do not stop scrapes; 700 idle
    connections take at most the cap's descriptors and are all still
    answered or cut, never queued in the daemon for ever."""
    raise_nofile()
    with images(MiB, "zero") as imgs:
        p, port = metrics_peer(imgs[0][1], MiB)
        flood = None
        try:
            fig = Figures(p.proc.pid)
            base = fig.fds_now()
            flood = Flood([port], {"slowloris": 2})
            mid_request(flood, port, 2)
            took = scrape(port)
            # Answered while both were still mid-request: one that waited
            # for them would have waited until they were cut.
            flood.step(0)
            check(not flood.closed_by_daemon, f"slow clients cut: {flood.closed_by_daemon}")
            flood.close()
            flood = Flood([port], {"idle": CAP + 188})

            def full():
                flood.step()
                fig.sample()
                return len(flood.closed_by_daemon) >= 188
            wait_until("the daemon to cut the idle crowd down to its cap", full, every=0,
                       seen=lambda: f"{len(flood.closed_by_daemon)} cut")
            # A latency test: a newcomer finds a place at once; without one
            # it would wait for the idle ones' deadline.
            took_full = scrape(port)
            check(took_full < PROMPT, f"a scrape beside a full cap took {took_full:.2f} s")
            print(f"  scrape beside 2 slow clients {took * 1000:.1f} ms, beside {CAP + 188} idle "
                  f"{took_full * 1000:.1f} ms; descriptors {base} -> peak {fig.fds}")
            check(fig.fds <= base + CAP + 8, f"{fig.fds} descriptors (at start {base})")
        finally:
            if flood:
                flood.close()
            p.stop()


def mid_request(flood, port, count):
    """Steps the flood until the daemon holds its `count` connections and
    has read what they sent (the slow ones' first line)."""
    def there():
        flood.step(0.01)
        return flood.sent_first_lines() and listener_caught_up(port, count)
    wait_until(f"the daemon to hold {count} clients mid-request", there, every=0)


@test
def test_sigterm_and_quit_with_slow_clients_connected():
    """A slow client mid-request on each daemon: SIGTERM ends one, quit the
    other, each at once (the server stopped first and waited for it)."""
    with images(MiB, "zero") as imgs:
        for how in ("sigterm", "quit"):
            p, port = metrics_peer(imgs[0][1], MiB, tag=f"mh-{how}")
            scrape(port)
            flood = Flood([port], {"slowloris": 2, "idle": 2})
            try:
                mid_request(flood, port, 4)
                end = ((lambda: p.proc.send_signal(signal.SIGTERM)) if how == "sigterm"
                       else (lambda: p.qmp.execute("quit")))
                took = ended_within(p, end)
                print(f"  {how}: ended in {took * 1000:.0f} ms with slow clients connected")
            finally:
                flood.close()
                p.stop()


@test
def test_500_hostile_connections_beside_a_migration():
    """500 hostile connections on the destination's /metrics (slowloris,
    endless header lines, idle, huge Range), a few slow ones on the
    source's, while 256 MiB migrate between them: the migration
    completes byte for byte, a well-behaved scraper of both is answered
    every time, the destination's anonymous memory and descriptors stay
    bounded, Range answers stay one text's size, connections are cut at
    their deadline, and SIGTERM (destination) and quit (source) end them
    at once with the flood still connected."""
    raise_nofile()
    size = 256 * MiB
    counts = {"slowloris": 150, "endless": 50, "idle": 200, "range": 100}
    floods = []
    with images(size, "random") as imgs:
        (_, src_img, dst_img, _), = imgs
        s, sport = metrics_peer(src_img, size, "source", "mh-src")
        d, dport = metrics_peer(dst_img, size, "dest", "mh-dst")
        scraper = None
        try:
            fig = Figures(d.proc.pid)
            base_anon, base_fds = fig.anon_now(), fig.fds_now()
            floods.append(Flood([dport], counts))
            floods.append(Flood([sport], {"slowloris": 16, "idle": 8}))
            flood = floods[0]
            scraper = Scraper([sport, dport])
            s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 80 * MiB})
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{start_incoming(d)}")
            t0, done = time.monotonic(), None
            first_round = counts["slowloris"] + counts["idle"]

            def over():
                """The migration ended and the first round of slow and idle
                connections all met their deadline, the flood on meanwhile."""
                nonlocal done
                for f in floods:
                    f.step(0.02)
                fig.sample()
                if done is None and s.status()["status"] in ("completed", "failed", "cancelled"):
                    done = time.monotonic() - t0
                return done is not None and len(
                    flood.cut(("slowloris", "idle"), first=True)) >= first_round
            wait_until("the migration's end and the first round's deadlines", over, every=0,
                       seen=lambda: f"migration ended: {done is not None}, "
                       f"{len(flood.cut(('slowloris', 'idle'), first=True))} of {first_round} cut")
            scraper.stop()
            wait_status(s, ("completed",), 60)
            wait_status(d, ("completed",), 60)
            check(files_equal(src_img, dst_img), "images differ")
            lat = sorted(scraper.latencies) or [float("inf")]
            cut = flood.cut(("slowloris", "idle"))
            print(f"  {sum(counts.values())} hostile connections ({flood.opened} opened in all), "
                  f"256 MiB migrated in {done:.2f} s; destination: anonymous memory "
                  f"{base_anon / MiB:.1f} -> peak {fig.anon / MiB:.1f} MiB (peak RSS with the "
                  f"image's pages {fig.hwm() / MiB:.0f} MiB), descriptors {base_fds} -> "
                  f"peak {fig.fds}; {len(lat)} scrapes, median {lat[len(lat) // 2] * 1000:.1f} ms, "
                  f"max {lat[-1] * 1000:.1f} ms, {len(scraper.failures)} failed; largest Range "
                  f"answer {flood.range_answer_max} bytes; slow/idle cut after "
                  f"{min(cut, default=0):.1f}-{max(cut, default=0):.1f} s")
            check(not scraper.failures, scraper.failures[:5])
            # A latency test: no scrape waits for a hostile client.
            check(len(lat) >= 20 and lat[-1] < PROMPT, f"scrape latencies {lat[-5:]}")
            check(fig.anon - base_anon < 32 * MiB, f"anonymous memory {fig.anon / MiB:.1f} MiB")
            check(fig.fds <= base_fds + CAP + 16, f"{fig.fds} descriptors")
            check(flood.range_answer_max < 64 * 1024, f"a Range answer of {flood.range_answer_max}")
            # Timed from before the connect to the cut's arrival: none can
            # come before the deadline; a late one means a late sweep.
            check(cut and min(cut) > DEADLINE - 0.5 and max(cut) < DEADLINE + 1.5, cut)
            check(flood.open_count() == sum(counts.values()), flood.open_count())
            took_term = ended_within(d, lambda: d.proc.send_signal(signal.SIGTERM))
            took_quit = ended_within(s, lambda: s.qmp.execute("quit"))
            print(f"  with the flood connected: SIGTERM ended the destination in "
                  f"{took_term * 1000:.0f} ms, quit the source in {took_quit * 1000:.0f} ms")
        finally:
            if scraper:
                scraper.stop()
            for f in floods:
                f.close()
            try:
                s.stop()  # raises on a loop stall: the destination is still stopped
            finally:
                d.stop()


if __name__ == "__main__":
    main()
