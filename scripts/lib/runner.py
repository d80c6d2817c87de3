"""Starting qmigd and QEMU 10 processes, driving a migration, checking RAM.

Shared by scripts/qmig, scripts/demo.sh, the benchmarks and the
integration tests. Every process started here is ended here, by pid.
"""
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time

try:
    import loop_watch  # the tests' loop-stall guard: not installed with qmig
except ImportError:
    loop_watch = None
from qmp import QMP, QMPError
from waiting import wait_until

_LIB = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.abspath(os.path.join(_LIB, "..", ".."))
# $QMIGD, else the qmigd that came with these modules: this checkout's build
# (scripts/lib -> build/bin/qmigd) or, installed (PREFIX/lib/qmigd/lib),
# PREFIX/bin/qmigd; else one on the PATH.
if os.path.basename(os.path.dirname(_LIB)) == "scripts":
    _built = os.path.join(ROOT, "build", "bin", "qmigd")
else:
    _built = os.path.abspath(os.path.join(_LIB, "..", "..", "..", "bin", "qmigd"))
QMIGD = os.environ.get("QMIGD") or (_built if os.path.exists(_built)
                                    else shutil.which("qmigd") or _built)
QEMU = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
PAGE = 4096


def unique_name(tag):
    return f"qmigd-{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Where processes' logs go: ctest gives each integration test a directory
# of its own in the build tree (kept for a failed run to read), else /tmp.
LOG_DIR = os.environ.get("QMIGD_LOG_DIR", "/tmp")
# QMIGD_SANDBOX=on (what the release build's ctest sets): every qmigd the
# tests start runs confined (--sandbox), unless the test gives its own.
SANDBOX = os.environ.get("QMIGD_SANDBOX", "")
# QMIGD_SANITIZED=address|thread (the sanitizer builds' ctest sets it): the
# daemon runs several times slower and its RSS holds the sanitizer's shadow
# memory, so bounds on time and memory are for the release build only.
SANITIZED = os.environ.get("QMIGD_SANITIZED", "")


def sandbox_allow_spawn():
    """qmigd peers started from now on run exec: commands: under
    QMIGD_SANDBOX their sandbox allows it (spawn=allow, the deny-list)."""
    global SANDBOX
    if SANDBOX:
        SANDBOX = "on,spawn=allow"


@contextlib.contextmanager
def sandbox_spawning():
    """sandbox_allow_spawn() for the peers started within."""
    global SANDBOX
    saved = SANDBOX
    sandbox_allow_spawn()
    try:
        yield
    finally:
        SANDBOX = saved


def proc_status(pid, tid=None):
    """/proc/PID/status (or a thread's) as {field: text}; numbers stay text
    ("VmRSS": "1234 kB"): int(status[k].split()[0]) reads them."""
    path = f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status"
    with open(path) as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def log_file(name, ext=".log"):
    os.makedirs(LOG_DIR, exist_ok=True)
    return os.path.join(LOG_DIR, name + ext)


class Peer:
    """A running qmigd or QEMU process with its QMP connection. `env`: a
    function of the open log file returning variables to add to the
    process's environment (a journal stream is named by its inode)."""

    def __init__(self, kind, role, ram, tag, extra=None, log_dir=None, wrap=None,
                 machine=None, env=None):
        self.kind, self.role, self.ram = kind, role, ram  # ram: list of (name, path, size)
        self.qmp_path = os.path.join("/tmp", unique_name(tag) + ".qmp")
        name = os.path.basename(self.qmp_path)
        self.log_path = (os.path.join(log_dir, name + ".log") if log_dir else log_file(name))
        if kind == "qemu" and machine is not None:  # a whole machine (linux_guest.py)
            argv = [QEMU] + machine + ["-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
            if role == "dest":
                argv += ["-incoming", "defer"]
        elif kind == "qemu":
            (name, path, size), = ram
            argv = [QEMU, "-M", "none", "-nodefaults", "-display", "none",
                    "-object", f"memory-backend-file,id={name},size={size},mem-path={path},share=on",
                    "-machine", f"memory-backend={name}",
                    "-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
            if role == "dest":
                argv += ["-incoming", "defer"]
        else:
            argv = [QMIGD, "source" if role == "source" else "dest", "--qmp", self.qmp_path]
            for name, path, size in ram:
                argv += ["--ram", f"{name}={path},size={size}"]
        argv += extra or []
        if kind != "qemu" and SANDBOX and "--sandbox" not in argv:
            argv += ["--sandbox", SANDBOX]
        argv = (wrap or []) + argv  # e.g. ip netns exec NS: the pid stays the daemon's
        self.log = open(self.log_path, "w")
        extra_env = env(self.log) if env else {}
        self.watch = None
        if (kind != "qemu" and loop_watch and loop_watch.STALL_GUARD
                and "NOTIFY_SOCKET" not in extra_env):
            self.watch = loop_watch.LoopWatch(os.path.basename(self.qmp_path))
            extra_env = {**extra_env, **self.watch.env()}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **extra_env} if extra_env else None)
        self.qmp = None
        try:
            # Its start may wait 20 s and more for the CPU when tests run
            # side by side on a busy machine (seen twice for QEMU).
            self.qmp = QMP(self.qmp_path, timeout=20, startup=60)
        except Exception:
            self.stop()
            raise

    def set_migration(self, multifd, channels=2, zpd=None, max_bandwidth=0, events=False,
                      extra_params=None, mapped_ram=False):
        caps = [{"capability": "multifd", "state": bool(multifd)},
                {"capability": "events", "state": bool(events)},
                {"capability": "mapped-ram", "state": bool(mapped_ram)}]
        self.qmp.cmd("migrate-set-capabilities", capabilities=caps)
        params = {"multifd-channels": channels, "max-bandwidth": max_bandwidth}
        if zpd:
            params["zero-page-detection"] = zpd
        params.update(extra_params or {})
        self.qmp.cmd("migrate-set-parameters", params)

    def status(self):
        return self.qmp.cmd("query-migrate")

    def release_monitor(self):
        """QEMU serves one QMP client at a time: let another one in."""
        self.qmp.close()

    def reconnect_monitor(self):
        self.qmp = QMP(self.qmp_path)

    def stop(self):
        # The loop's silence counts until its STOPPING=1 (the loop took the
        # quit), or else until the daemon ends if it still lives now; a
        # test that killed it ends the count at its last ping.
        alive = self.proc.poll() is None
        if self.qmp:
            try:
                self.qmp.execute("quit")
            except Exception:
                pass
            self.qmp.close()
        if self.proc.poll() is None:
            try:
                # A hang guard only: a sanitized daemon's exit (leak check)
                # on a busy machine takes seconds.
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        ended = time.time()
        self.log.close()
        try:
            os.unlink(self.qmp_path)
        except OSError:
            pass
        stall = self.end_loop_watch(ended if alive else None)
        if self.kind == "qmigd":
            self.check_clean_exit()
        if stall:
            raise AssertionError(stall)

    def end_loop_watch(self, until):
        """What fails the test when the daemon's loop thread was silent for
        more than loop_watch.STALL_LIMIT seconds while it lived, or None."""
        if not self.watch:
            return None
        watch, self.watch = self.watch, None
        watch.close()
        gap = watch.worst_gap(until)
        loop_watch.record(LOG_DIR, f"qmigd {self.role} {os.path.basename(self.log_path)}", gap,
                          len(watch.pings))
        if gap and gap[0] > loop_watch.STALL_LIMIT:
            return loop_watch.stall_message(f"qmigd {self.role}", gap, watch, until, self.log_path,
                                            self.log_text())
        return None

    SANITIZER_MARKS = ("ERROR: AddressSanitizer", "WARNING: ThreadSanitizer",
                       "ERROR: LeakSanitizer", "runtime error:")

    def check_clean_exit(self):
        """A qmigd must exit 0 on quit with no sanitizer report in its log."""
        text = self.log_text()
        for mark in self.SANITIZER_MARKS:
            at = text.find(mark)
            if at >= 0:
                raise AssertionError(f"qmigd {self.role} sanitizer report in {self.log_path}:\n"
                                     + text[max(0, at - 200):at + 3000])
        if self.proc.returncode not in (0, -signal.SIGKILL):
            raise AssertionError(f"qmigd {self.role} exited with {self.proc.returncode}; "
                                 f"log {self.log_path}")

    def log_text(self):
        # A log may hold a peer's bytes that are not UTF-8 (block names).
        with open(self.log_path, errors="replace") as f:
            return f.read()


def stop_all(*peers):
    """Stops every peer given (None skipped), then raises the first failure
    one of them reported (a stall, an exit status): one failing never
    leaves the others running."""
    first = None
    for p in peers:
        try:
            if p:
                p.stop()
        except Exception as e:
            first = first or e
    if first:
        raise first


def end_process(proc, grace=5):
    """SIGTERM, and SIGKILL if it is still there after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_status(peer, want, timeout=120.0, progress=None, fail_on=("failed", "cancelled")):
    """Waits for the peer's query-migrate status to be one of `want` and
    returns the reply; a status in `fail_on` (and not in `want`) fails at
    once."""
    last = {}

    def reached():
        info = last["info"] = peer.status()
        st = info.get("status")
        if progress:
            progress(info)
        if st in want:  # first: a caller may want what fails by default ("failed")
            return info
        if st in fail_on:
            raise RuntimeError(f"{peer.kind} {peer.role}: migration {st}: {info.get('error-desc')}")
        return None
    return wait_until(f"{peer.kind} {peer.role} to be {'/'.join(want)}", reached, timeout,
                      seen=lambda: last["info"].get("status"))


def migrate(src, dst, multifd, channels=2, zpd="multifd", max_bandwidth=0, timeout=300,
            progress=None, dst_uri_host="127.0.0.1", events=False, unix_path=None, params=None):
    """Configures both sides, runs one migration, returns (src_info, dst_info, seconds).
    Over TCP to dst_uri_host, or over a unix socket at unix_path. `params`:
    more migration parameters for both sides (multifd-compression, ...)."""
    src.set_migration(multifd, channels, zpd, max_bandwidth, events, extra_params=params)
    dst.set_migration(multifd, channels, None, max_bandwidth, events, extra_params=params)
    if unix_path:
        uri = f"unix:{unix_path}"
        dst.qmp.cmd("migrate-incoming", uri=uri)
    else:
        uri = f"tcp:{dst_uri_host}:{start_incoming(dst, dst_uri_host)}"
    t0, wall0 = time.monotonic(), time.time()
    src.qmp.cmd("migrate", uri=uri)
    src_info = wait_status(src, ("completed",), timeout, progress)
    dst_info = wait_status(dst, ("completed",), timeout)
    secs = time.monotonic() - t0
    if events:
        # With events on, the end is when the later side said "completed"
        # (the event's own timestamp), not when polling saw it: polling
        # every 20 ms is too coarse for migrations of 0.2 s.
        ends = [completed_at(p) for p in (src, dst)]
        if None not in ends:
            secs = max(ends) - wall0
    return src_info, dst_info, secs


def completed_at(peer):
    """Wall-clock time of the peer's MIGRATION completed event, or None."""
    for ev in peer.qmp.poll_events():
        if ev.get("event") == "MIGRATION" and ev.get("data", {}).get("status") == "completed":
            ts = ev["timestamp"]
            return ts["seconds"] + ts["microseconds"] / 1e6
    return None


def start_incoming(dst, host="127.0.0.1"):
    """migrate-incoming on port 0; returns the port the destination reports."""
    dst.qmp.cmd("migrate-incoming", uri=f"tcp:{host}:0")
    addr = dst.status()["socket-address"][0]
    return int(addr["port"])


def files_equal(a, b, chunk=1 << 22):
    """Byte-for-byte comparison. Both buffers are allocated once and reused:
    a fresh 16 MiB bytes object per read() faults its memory in every time,
    which on a paravirtualised host costs ~14 us per page and made comparing
    two 4 GiB images take 30 s instead of 2."""
    x, y = bytearray(chunk), bytearray(chunk)
    with open(a, "rb", buffering=0) as fa, open(b, "rb", buffering=0) as fb:
        while True:
            n, m = fa.readinto(x), fb.readinto(y)
            if n != m:
                return False
            if n < chunk:  # the tail: slices copy, but only once
                return x[:n] == y[:n]
            if x != y:
                return False


def fs_type(path):
    """The file system type of the mount holding path (longest mount prefix)."""
    path = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            mnt, typ = line.split()[1:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


class _MappedWriter:
    """write() through a shared mapping: hugetlbfs takes no write(2)."""

    def __init__(self, path, size):
        import mmap
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED)
        self.pos = 0

    def write(self, data):
        self.map[self.pos:self.pos + len(data)] = data
        self.pos += len(data)

    def truncate(self, size):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.map.close()
        os.close(self.fd)


def make_image(path, size, content, seed=1):
    """Writes a RAM image: zero (zero pages written, so the memory is
    allocated) | sparse (a hole: never touched) | random | mixed | text |
    garbage (all 0xAA)."""
    import random
    rng = random.Random(seed)
    pages = size // PAGE
    hugetlbfs = fs_type(path) == "hugetlbfs"
    with (_MappedWriter(path, size) if hugetlbfs else open(path, "wb")) as f:
        if content == "sparse":
            f.truncate(size)
            return
        if content == "zero":
            chunk = bytes(1 << 24)
            left = size
            while left:
                n = min(left, len(chunk))
                f.write(chunk[:n])
                left -= n
            return
        if content == "random":
            left = size
            while left:
                n = min(left, 1 << 24)
                f.write(os.urandom(n))
                left -= n
            return
        if content == "garbage":
            f.write(bytes([0xAA]) * size)
            return
        if content == "text":
            # Pages of words, as a guest's page cache holds: no zero pages,
            # no two pages alike (each starts with its number).
            words = [w.encode() for w in ("migration", "page", "guest", "memory", "the",
                                          "of", "channel", "dirty", "zero", "QEMU", "ram",
                                          "block", "socket", "kernel", "file", "and")]
            body = b" ".join(rng.choice(words) for _ in range(2 * PAGE))[:PAGE]
            for i in range(pages):
                stamp = b"%d " % i
                f.write(stamp + body[len(stamp):])
            return
        assert content == "mixed"
        # Runs of zero pages, random pages, single-byte pages and 0xff pages.
        zero = bytes(PAGE)
        ff = b"\xff" * PAGE
        first = b"\x01" + bytes(PAGE - 1)
        last = bytes(PAGE - 1) + b"\x80"
        i = 0
        while i < pages:
            run = min(pages - i, rng.randint(1, 64))
            kind = rng.random()
            if kind < 0.40:
                f.write(zero * run)
            elif kind < 0.85:
                f.write(os.urandom(PAGE * run))
            elif kind < 0.90:
                f.write(first * run)
            elif kind < 0.95:
                f.write(last * run)
            else:
                f.write(ff * run)
            i += run


def remove(*paths):
    for p in paths:
        # Side files sit beside the image, or in /dev/shm for hugetlbfs images
        # (ramstate/backing.h, side_file_path).
        shm = "/dev/shm/qmigd" + os.path.abspath(p).replace("/", "_")
        for q in (p, p + ".dirty", p + ".ctl", shm + ".dirty", shm + ".ctl"):
            try:
                os.unlink(q)
            except OSError:
                pass


class Guest:
    """A `qmigd guest` workload dirtying a RAM image (ended by pid)."""

    def __init__(self, image, rate, pattern="hot", hot_set=64 << 20, seed=1, name="mem",
                 write_bytes=4096):
        # Beside the image, except on hugetlbfs (qmigd's side-file rule).
        self.control = image + ".ctl"
        if fs_type(image) == "hugetlbfs":
            self.control = "/dev/shm/qmigd" + os.path.abspath(image).replace("/", "_") + ".ctl"
        self.log_path = log_file(unique_name('guest'))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [QMIGD, "guest", "--ram", f"{name}={image}", "--rate", str(rate), "--pattern", pattern,
             "--hot-set", str(hot_set), "--seed", str(seed), "--write-bytes", str(write_bytes)],
            stdout=self.log, stderr=subprocess.STDOUT)
        def writing():
            if self.proc.poll() is not None:
                raise RuntimeError(f"guest exited with {self.proc.returncode}; "
                                   f"log {self.log_path}")
            return self.pages_written()
        try:
            wait_until(f"the guest to write pages (log {self.log_path})", writing)
        except BaseException:
            self.stop()
            raise

    def record(self):
        """(pause_req, paused_ack, throttle_pct, guest_pid, heartbeat, pages_written)"""
        import struct
        with open(self.control, "rb") as f:
            return struct.unpack("<6I2Q", f.read(40))[2:]

    def pages_written(self):
        try:
            return self.record()[5]
        except (OSError, Exception):
            return 0

    def stop(self):
        end_process(self.proc)
        self.log.close()
        try:
            os.unlink(self.control)
        except OSError:
            pass
