"""A fake postcopy destination for the integration tests: parses what a
qmigd source sends over one connection (one RAM block, "mem"), answers
its PINGs and ends with SHUT(0); the test sends page requests on the
return path from its callbacks, on the parser's thread."""
import socket
import struct
import threading
import time

from itest import check
from fixtures import MiB
from runner import wait_status

PC = [{"capability": "postcopy-ram", "state": True}, {"capability": "events", "state": True}]


def with_postcopy(*peers_):
    for p in peers_:
        p.qmp.cmd("migrate-set-capabilities", capabilities=PC)


def rp(type_, payload):
    return struct.pack(">HH", type_, len(payload)) + payload


def req_pages_id(start, length, block=b"mem"):
    return rp(3, struct.pack(">QIB", start, length, len(block)) + block)


def req_pages(start, length):
    return rp(4, struct.pack(">QI", start, length))


class StreamReader:
    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def take(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("stream ended")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def u8(self):
        return self.take(1)[0]

    def be16(self):
        return struct.unpack(">H", self.take(2))[0]

    def be32(self):
        return struct.unpack(">I", self.take(4))[0]

    def be64(self):
        return struct.unpack(">Q", self.take(8))[0]


class FakePostcopyDestination:
    """Reads a qmigd source's postcopy stream of one block ("mem"): notes
    every page after the package, and calls on_package(conn) once the
    package is in, so the test can send requests on the return path, and
    on_page(conn, offset) for each page after it, if given."""

    def __init__(self, on_package, on_page=None):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.on_package = on_package
        self.on_page = on_page
        self.conn = None
        self.after = []       # (offset, arrival time) of pages after the package
        self.package_at = None
        self.error = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        c, _ = self.srv.accept()
        c.settimeout(30)
        try:
            self.parse(c)
        except Exception as e:  # the test reads it
            self.error = e
        finally:
            c.close()

    def ram(self, f):
        while True:
            word = f.be64()
            flags, addr = word & 0xfff, word & ~0xfff
            if flags & 0x10:  # EOS
                return
            if flags & 0x4:  # MEM_SIZE
                f.take(f.u8())
                f.be64()
                continue
            if not flags & 0x20:
                f.take(f.u8())
            if flags & 0x2:
                f.u8()
            else:
                f.take(4096)
            if self.package_at is not None:
                self.after.append((addr, time.monotonic()))
                if self.on_page:
                    self.on_page(self.conn, addr)

    def parse(self, c):
        self.conn = c
        f = StreamReader(c)
        f.take(8)
        check(f.u8() == 7, "no configuration")
        f.take(f.be32())
        while True:
            t = f.u8()
            if t == 0x08:
                cmd, length = f.be16(), f.be16()
                body = f.take(length)
                if cmd == 2:  # PING
                    c.sendall(rp(2, body))
                if cmd == 7:  # PACKAGED
                    f.take(struct.unpack(">I", body)[0])
                    self.package_at = time.monotonic()
                    self.on_package(c)
            elif t == 0x01:
                f.be32()
                f.take(f.u8())
                f.take(8)
                self.ram(f)
                f.take(5)
            elif t in (0x02, 0x03):
                f.be32()
                self.ram(f)
                f.take(5)
            elif t == 0x00:
                c.sendall(rp(1, b"\0\0\0\0"))  # SHUT(0)
                return
            else:
                raise AssertionError(f"unexpected section type {t}")

    def close(self):
        self.srv.close()
        self.thread.join(timeout=30)


def fake_run(s, on_package, bandwidth, on_page=None):
    fake = FakePostcopyDestination(on_package, on_page)
    try:
        with_postcopy(s)
        s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 4 * MiB,
                                             "max-postcopy-bandwidth": bandwidth})
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{fake.port}")
        s.qmp.cmd("migrate-start-postcopy")
        si = wait_status(s, ("completed", "failed"), timeout=60, fail_on=())
    finally:
        fake.close()
    return fake, si
