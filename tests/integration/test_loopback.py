#!/usr/bin/env python3
"""qmigd -> qmigd over loopback only (no QEMU): the set the sanitizer
builds run (ASan+UBSan, TSan), covering the thread hand-offs."""
import re
import subprocess

from itest import test, main, check
from fixtures import run_cell, MiB
from fixtures import images, peers, begin, good_run
from runner import wait_status

SIZE = 32 * MiB

for multifd, ch, zpd in [(False, 0, "legacy"), (False, 0, "none"), (True, 1, "multifd"),
                         (True, 4, "multifd"), (True, 2, "legacy"), (True, 8, "none")]:
    def fn(multifd=multifd, ch=ch, zpd=zpd):
        run_cell("qmigd", "qmigd", SIZE, "mixed", multifd, ch or 2, zpd, blocks=("mem", "mem2"))
    fn.__name__ = f"test_{'multifd' + str(ch) if multifd else 'plain'}_{zpd}"
    test(fn)


@test
def test_cancel_then_migrate():
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        begin(src, dst, bandwidth=8 * MiB)
        src.qmp.cmd("migrate_cancel")
        wait_status(src, ("cancelled",), timeout=10, fail_on=("failed", "completed"))
        wait_status(dst, ("failed",), timeout=10, fail_on=("completed",))
        good_run(src, imgs, dst)


def send_buffers(dst):
    """SO_SNDBUF (ss's skmem tb) of every socket connected to dst's port."""
    port = dst.status()["socket-address"][0]["port"]
    out = subprocess.run(["ss", "-tmnH", "state", "established", "dport", f"= :{port}"],
                         capture_output=True, text=True, check=True).stdout
    return [int(x) for x in re.findall(r"\btb(\d+)", out)]


@test
def test_local_destination_gets_small_send_buffers():
    """A destination on this host: every channel's send buffer is
    --local-send-buffer (the kernel shows it doubled), the log says so; with
    0 the kernel's autotuning stays and the log says nothing."""
    for arg, want in ((None, 2 * 131072), ("65536", 2 * 65536), ("0", None)):
        extra = ["--local-send-buffer", arg] if arg else None
        with images(SIZE, "random") as imgs, peers("qmigd", "qmigd", imgs, extra) as (src, dst):
            begin(src, dst, bandwidth=4 * MiB)
            tbs = send_buffers(dst)
            src.qmp.cmd("migrate_cancel")
            wait_status(src, ("cancelled",), timeout=10, fail_on=("failed", "completed"))
            with open(src.log_path) as f:
                said = "destination is on this host" in f.read()
            check(len(tbs) == 3, f"main + 2 multifd sockets expected, ss shows {tbs}")
            if want:
                check(tbs == [want] * 3 and said, f"--local-send-buffer {arg}: {tbs}, {said}")
            else:
                check(2 * 131072 not in tbs and not said, f"autotuning expected: {tbs}, {said}")


if __name__ == "__main__":
    main()
