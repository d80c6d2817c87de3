#!/usr/bin/env python3
"""qmigd -> qmigd over loopback only (no QEMU): the set the sanitizer
builds run (ASan+UBSan, TSan), covering the thread hand-offs."""
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


if __name__ == "__main__":
    main()
