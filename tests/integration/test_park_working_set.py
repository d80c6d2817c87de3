#!/usr/bin/env python3
"""A parked VM's working set: a `qmigd source --ram-dir` resumed by
postcopy records the pages its destination asks for in its first moments
(DIR/working-set.bin, published by rename after fsync), and the next
postcopy resume from the same directory sends them first, right after
the package, in that order, before the background walk. A fake
destination (postcopy_fake.py) asks for known pages and notes the order
of every page after the package. Also: x-working-set-pages and
x-working-set-requested in query-migrate and `info migrate`; a hostile
record file (truncated, a range past its block, a huge count, a block the
VM does not have, a symbolic link) is ignored with one log line, the
resume goes on; --working-set off; a read-only directory resumes twice at
once, sending its working set but recording nothing. A QEMU -M none guest
is parked in seconds, so these run in the sanitizer builds too."""
import os
import shutil
import struct
import subprocess
import tempfile
import threading

from itest import test, main, check, skip
from postcopy_fake import req_pages_id, fake_run
from fixtures import MiB
from runner import Peer, migrate, make_image, stop_all

SIZE = 64 * MiB
WORK = tempfile.mkdtemp(prefix="qmigd-ws-", dir="/dev/shm")
SRC_IMG = os.path.join(WORK, "guest.ram")
make_image(SRC_IMG, SIZE, "mixed", seed=11)
# The pages the first resume's guest asks for, in its order: scattered,
# none where the background walk starts.
ASKED = [40 * MiB, 63 * MiB, 17 * MiB + 8192, 17 * MiB + 12288, 50 * MiB]
WS_FILE = "working-set.bin"
_parked = {}


def parked():
    """A QEMU -M none guest of one block "mem", parked once."""
    if "dir" not in _parked:
        d = tempfile.mkdtemp(prefix="vm-", dir=WORK)
        guest = Peer("qemu", "source", [("mem", SRC_IMG, SIZE)], "ws-guest")
        park = Peer("qmigd", "dest", [], "ws-park", extra=["--ram-dir", d])
        try:
            si, di, _ = migrate(guest, park, False, 1, "legacy")
            check(si["status"] == "completed" and di["status"] == "completed", (si, di))
        finally:
            stop_all(park, guest)
        _parked["dir"] = d
    return _parked["dir"]


def copy_parked(tag, with_ws=None):
    c = tempfile.mkdtemp(prefix=tag + "-", dir=WORK)
    for name in os.listdir(parked()):
        if name != WS_FILE:
            shutil.copy(os.path.join(parked(), name), c)
    if with_ws is not None:
        with open(os.path.join(c, WS_FILE), "wb") as f:
            f.write(with_ws)
    return c


def ws_bytes(ranges, blocks=(("mem", SIZE),), count=None):
    """working-set.bin (daemon/park/working_set.h): ranges (block index,
    offset, pages)."""
    out = b"QMIGD-WS" + struct.pack(">II", 1, len(blocks))
    for name, size in blocks:
        out += struct.pack(">B", len(name)) + name.encode() + struct.pack(">Q", size)
    out += struct.pack(">I", len(ranges) if count is None else count)
    for b, off, pages in ranges:
        out += struct.pack(">HQI", b, off, pages)
    return out


def resume(directory, tag, ask=(), on_page=None, extra=()):
    """A postcopy resume of `directory` into the fake destination, which asks
    for `ask` once the package is in; returns (pages after the package in
    their order, the source's query-migrate, its `info migrate`, its log)."""
    src = Peer("qmigd", "source", [], tag, extra=["--ram-dir", directory, *extra])
    try:
        def on_package(c):
            for off in ask:
                c.sendall(req_pages_id(off, 4096))
        fake, si = fake_run(src, on_package, 64 * MiB, on_page)
        check(fake.error is None, f"fake destination: {fake.error}")
        check(si["status"] == "completed", si)
        hmp = src.qmp.cmd("human-monitor-command", **{"command-line": "info migrate"})
        return [o for o, _ in fake.after], si, hmp, src.log_text()
    finally:
        src.stop()


def ws_ranges_in(directory):
    with open(os.path.join(directory, WS_FILE), "rb") as f:
        data = f.read()
    check(data[:8] == b"QMIGD-WS", data[:16])
    at = 16 + 1 + 3 + 8
    (n,) = struct.unpack(">I", data[at:at + 4])
    return [struct.unpack(">HQI", data[at + 4 + 14 * i:at + 18 + 14 * i]) for i in range(n)]


@test
def test_second_resume_sends_the_first_ones_requests_first():
    d = copy_parked("twice")
    # Temporaries of earlier writes: one whose writer is gone (killed
    # before its rename) is removed by the next write; a live writer's is not.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{WS_FILE}.tmp.{dead.pid}.0"
    live = f"{WS_FILE}.tmp.{os.getpid()}.0"
    for name in (stale, live):
        with open(os.path.join(d, name), "wb") as f:
            f.write(b"half")
    pages, si, hmp, log = resume(d, "ws-first", ASKED)
    check(stale not in os.listdir(d) and live in os.listdir(d), os.listdir(d))
    os.unlink(os.path.join(d, live))
    check(si["ram"]["postcopy-requests"] == len(ASKED), si["ram"])
    check(si["ram"]["x-working-set-pages"] == 0, si["ram"])
    # While it records, the walk waits for the guest's requests to pause:
    # the requested pages are the first after the package.
    check(pages[:len(ASKED)] == ASKED, (pages[:8], ASKED))
    check("working set of 0 pages" in log and "kept in" in log, log[-2000:])
    ranges = ws_ranges_in(d)
    # In the order asked for, adjacent pages as one range.
    check(ranges == [(0, 40 * MiB, 1), (0, 63 * MiB, 1), (0, 17 * MiB + 8192, 2),
                     (0, 50 * MiB, 1)], ranges)
    check(not [n for n in os.listdir(d) if ".tmp" in n], os.listdir(d))
    st = os.stat(os.path.join(d, WS_FILE))
    check(st.st_mode & 0o777 == 0o600, oct(st.st_mode))

    # The second resume: the recorded pages are the first after the
    # package, in their order; the guest then asks for one of them anyway.
    def ask_again(c, off):
        if off == 63 * MiB:
            c.sendall(req_pages_id(40 * MiB, 4096))
    pages, si, hmp, _ = resume(d, "ws-second", on_page=ask_again,
                               extra=["--working-set-around", "0"])
    check(pages[:len(ASKED)] == ASKED, (pages[:8], ASKED))
    check(len(pages) == len(set(pages)), "a page was sent twice")
    check(si["ram"]["x-working-set-pages"] == len(ASKED), si["ram"])
    check(si["ram"]["x-working-set-requested"] == 1, si["ram"])
    check(si["ram"]["postcopy-requests"] == 1, si["ram"])
    check("working set sent: 5 pages, then requested: 1 pages" in hmp, hmp)
    # Nothing new was asked for in its window: the record stays as it was.
    check(os.stat(os.path.join(d, WS_FILE)).st_mtime_ns == st.st_mtime_ns, "rewritten")
    print(f"  second resume: first pages {[p >> 12 for p in pages[:5]]} (pages), then "
          f"{len(pages) - 5} by the walk")
    # By default the aligned 2 MiB around each recorded page follows them,
    # in turn with the walk from the start of RAM (once the walk is not
    # held back for recording: a window of 0 records nothing).
    pages, si, _, _ = resume(d, "ws-around", extra=["--working-set-window", "0"])
    check(pages[:len(ASKED)] == ASKED, (pages[:8], ASKED))
    check(pages.index(40 * MiB + 4096) < pages.index(8 * MiB), "the span came after the walk")
    check(pages.index(1 * MiB) < pages.index(42 * MiB - 4096), "the walk waited for the spans")
    check(si["ram"]["x-working-set-pages"] == 4 * 512, si["ram"])


HOSTILE = [
    ("truncated", ws_bytes([(0, 40 * MiB, 1)])[:-3], "ranges in"),
    ("past the block", ws_bytes([(0, SIZE, 1)]), "not inside block 'mem'"),
    ("running over its end", ws_bytes([(0, SIZE - 4096, 2)]), "not inside block 'mem'"),
    ("huge count", ws_bytes([(0, 0, 1)], count=0xffffffff), "4294967295 ranges"),
    ("huge pages", ws_bytes([(0, 0, 0xffffffff)]), "not inside block 'mem'"),
    ("wrong block name", ws_bytes([(0, 0, 1)], blocks=(("pc.ram", SIZE),)),
     "no block 'pc.ram'"),
    ("wrong block size", ws_bytes([(0, 0, 1)], blocks=(("mem", 2 * SIZE),)), "bytes, not"),
    ("not a record", b"\0" * 4096, "not a working set file"),
]


@test
def test_hostile_working_set_files_are_ignored():
    for name, data, want in HOSTILE:
        d = copy_parked("hostile", data)
        pages, si, _, log = resume(d, "ws-hostile")
        lines = [l for l in log.splitlines() if "ignoring the working set" in l]
        check(len(lines) == 1 and want in lines[0], (name, want, lines))
        check(si["ram"]["x-working-set-pages"] == 0, (name, si["ram"]))
        check(pages[0] == 0, f"{name}: the walk did not go first: {pages[:4]}")
        print(f"  {name}: {lines[0].split('.bin')[-1][:70]}")
    # Something else in its place: not followed, not waited on.
    for name, make in (("symlink", lambda p: os.symlink("/dev/zero", p)),
                       ("fifo", lambda p: os.mkfifo(p))):
        d = copy_parked("hostile")
        make(os.path.join(d, WS_FILE))
        _, si, _, log = resume(d, "ws-" + name)
        check("ignoring the working set" in log, (name, log[-1500:]))
        check(si["ram"]["x-working-set-pages"] == 0, si["ram"])


@test
def test_working_set_off():
    d = copy_parked("off", ws_bytes([(0, 40 * MiB, 1)]))
    before = os.stat(os.path.join(d, WS_FILE)).st_mtime_ns
    pages, si, hmp, _ = resume(d, "ws-off", ASKED, extra=["--working-set", "off"])
    check("x-working-set-pages" not in si["ram"], si["ram"])
    check("working set" not in hmp, hmp)
    check(pages[0] != 40 * MiB, pages[:4])
    check(os.stat(os.path.join(d, WS_FILE)).st_mtime_ns == before, "recorded while off")
    # And the window: with none, nothing is recorded.
    d = copy_parked("nowindow")
    resume(d, "ws-nowindow", ASKED, extra=["--working-set-window", "0"])
    check(WS_FILE not in os.listdir(d), os.listdir(d))


@test
def test_read_only_directory_sends_its_working_set_twice_at_once():
    d = copy_parked("ro", ws_bytes([(0, 40 * MiB, 1), (0, 63 * MiB, 1)]))
    ro = tempfile.mkdtemp(prefix="ro-mount-", dir=WORK)
    if subprocess.run(["mount", "--bind", d, ro]).returncode != 0:
        skip("cannot bind-mount (not root?)", machine=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", ro], check=True)
        before = sorted((n, os.stat(os.path.join(ro, n)).st_mtime_ns) for n in os.listdir(ro))
        srcs = [Peer("qmigd", "source", [], f"ws-ro{i}", extra=["--ram-dir", ro])
                for i in range(2)]
        try:
            out = [None, None]

            def one(i):
                out[i] = fake_run(srcs[i], lambda c: c.sendall(req_pages_id(17 * MiB, 4096)),
                                  64 * MiB)
            ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)  # a hang guard: fake_run ends within its own wait
            check(None not in out, f"a resume did not end: {out}")
            for i, (fake, si) in enumerate(out):
                check(fake.error is None and si["status"] == "completed", (fake.error, si))
                # The request may come first: requests go before anything.
                after = [o for o, _ in fake.after if o != 17 * MiB]
                check(after[:2] == [40 * MiB, 63 * MiB], fake.after[:3])
                check(si["ram"]["x-working-set-pages"] >= 2, si["ram"])
                check("resuming without recording" in srcs[i].log_text(), "no log line")
        finally:
            stop_all(*srcs)
        after = sorted((n, os.stat(os.path.join(ro, n)).st_mtime_ns) for n in os.listdir(ro))
        check(after == before, "resuming changed the read-only directory")
    finally:
        subprocess.run(["umount", ro])


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(WORK, True)
