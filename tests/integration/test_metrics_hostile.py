#!/usr/bin/env python3
"""--metrics against strangers: whoever reaches the port may be hostile.
One endless header line does not grow the daemon; clients sending a byte
a second do not stop scrapes, and a pile of idle connections does not
take its descriptors; SIGTERM and quit end within 1 s whatever clients
are connected; and 500 hostile connections (a byte a second, endless
header lines, idle, a Range of 1,600 parts) beside a running 256 MiB
migration: the migration completes, a well-behaved scraper is answered
throughout, the daemon's memory and descriptors stay bounded (the peaks
are printed), and it shuts down within 1 s with them still open."""
import os
import resource
import selectors
import signal
import socket
import threading
import time
import urllib.request

from itest import test, main, check
from fixtures import images, MiB
from runner import Peer, proc_status, free_port, start_incoming, wait_status, files_equal

# What the daemon allows (daemon/service/metrics_server.h).
CAP = 512
DEADLINE = 5.0
RANGE = "Range: bytes=" + ",".join(f"{i}-{i}" for i in range(1600))


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def scrape(port, timeout=3.0):
    """Seconds a scrape of /metrics took; raises if it was not answered."""
    t = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        check(r.status == 200 and b"qmigd_info" in r.read(), r.status)
    return time.monotonic() - t


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
        self.closed_by_daemon = []  # (kind, seconds it was open)
        self.range_answer_max = 0
        self.opened = 0
        for kind, n in counts.items():
            for i in range(n):
                self.open(kind, ports[i % len(ports)])

    def open(self, kind, port):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        self.sel.register(s, selectors.EVENT_READ, {"kind": kind, "port": port, "t": time.monotonic(),
                                                    "sent": 0, "got": 0, "last": 0.0})
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
                self.closed_by_daemon.append((c["kind"], time.monotonic() - c["t"]))
                self.sel.unregister(s)
                s.close()
                self.open(c["kind"], c["port"])

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


def ended_within(peer, end, limit=1.0):
    """Seconds the daemon took to exit after end() (SIGTERM or quit)."""
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
            for _ in range(25):
                flood.step()
            took = scrape(port, timeout=2)
            flood.close()
            flood = Flood([port], {"idle": CAP + 188})
            t = time.monotonic()
            while time.monotonic() - t < 1.5:
                flood.step()
                fig.sample()
            took_full = scrape(port, timeout=2)
            print(f"  scrape beside 2 slow clients {took * 1000:.1f} ms, beside {CAP + 188} idle "
                  f"{took_full * 1000:.1f} ms; descriptors {base} -> peak {fig.fds}")
            check(fig.fds <= base + CAP + 8, f"{fig.fds} descriptors (at start {base})")
        finally:
            if flood:
                flood.close()
            p.stop()


@test
def test_sigterm_and_quit_with_slow_clients_connected():
    """A slow client mid-request on each daemon: SIGTERM ends one, quit the
    other, each within 1 s (the server stopped first and waited for it)."""
    with images(MiB, "zero") as imgs:
        for how in ("sigterm", "quit"):
            p, port = metrics_peer(imgs[0][1], MiB, tag=f"mh-{how}")
            scrape(port)
            flood = Flood([port], {"slowloris": 2, "idle": 2})
            try:
                for _ in range(10):
                    flood.step()
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
    within 1 s with the flood still connected."""
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
            while time.monotonic() - t0 < DEADLINE + 1.5 or done is None:
                for f in floods:
                    f.step(0.02)
                fig.sample()
                if done is None and s.status()["status"] in ("completed", "failed", "cancelled"):
                    done = time.monotonic() - t0
                check(time.monotonic() - t0 < 60, "the migration did not end in 60 s")
            scraper.stop()
            wait_status(s, ("completed",), 5)
            wait_status(d, ("completed",), 5)
            check(files_equal(src_img, dst_img), "images differ")
            lat = sorted(scraper.latencies) or [float("inf")]
            cut = [t for k, t in flood.closed_by_daemon if k in ("slowloris", "idle")]
            print(f"  {sum(counts.values())} hostile connections ({flood.opened} opened in all), "
                  f"256 MiB migrated in {done:.2f} s; destination: anonymous memory "
                  f"{base_anon / MiB:.1f} -> peak {fig.anon / MiB:.1f} MiB (peak RSS with the "
                  f"image's pages {fig.hwm() / MiB:.0f} MiB), descriptors {base_fds} -> "
                  f"peak {fig.fds}; {len(lat)} scrapes, median {lat[len(lat) // 2] * 1000:.1f} ms, "
                  f"max {lat[-1] * 1000:.1f} ms, {len(scraper.failures)} failed; largest Range "
                  f"answer {flood.range_answer_max} bytes; slow/idle cut after "
                  f"{min(cut, default=0):.1f}-{max(cut, default=0):.1f} s")
            check(not scraper.failures, scraper.failures[:5])
            check(len(lat) >= 20 and lat[-1] < 1.0, f"scrape latencies {lat[-5:]}")
            check(fig.anon - base_anon < 32 * MiB, f"anonymous memory {fig.anon / MiB:.1f} MiB")
            check(fig.fds <= base_fds + CAP + 16, f"{fig.fds} descriptors")
            check(flood.range_answer_max < 64 * 1024, f"a Range answer of {flood.range_answer_max}")
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
