#!/usr/bin/env python3
"""A 1 TiB guest that touched 8192 scattered pages migrates qmigd -> qmigd on
this small machine: the source never reads its never-written ranges (they go
as zero pages), the destination allocates only the data pages, and neither
daemon's memory grows with the guest. Times are reported, not asserted
(benchmarks stay benchmarks); memory and bytes are."""
import os
import random

from itest import test, main, check
from runner import Peer, migrate, remove, unique_name, PAGE, proc_status

TiB = 1 << 40
DATA_PAGES = 8192
RSS_LIMIT_KIB = 2 << 20  # 2 GiB


def peak_rss_kib(pid):
    return int(proc_status(pid).get("VmHWM", "0").split()[0])  # 0 once it has exited


def data_pages(path, size):
    """Offsets of the pages SEEK_DATA finds (the allocated ones)."""
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < size:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, pos, os.SEEK_HOLE)
            out.extend(range(pos, end, PAGE))
            pos = end
    finally:
        os.close(fd)
    return out


def sparse_cell(size, multifd, channels, zpd):
    def fn():
        src_img = f"/dev/shm/{unique_name('sparse-src')}.ram"
        dst_img = f"/dev/shm/{unique_name('sparse-dst')}.ram"
        rng = random.Random(size)
        want = {}
        src = dst = None
        try:
            with open(src_img, "wb") as f:
                f.truncate(size)
                for p in sorted(rng.sample(range(size // PAGE), DATA_PAGES)):
                    want[p * PAGE] = os.urandom(PAGE)
                    f.seek(p * PAGE)
                    f.write(want[p * PAGE])
            src = Peer("qmigd", "source", [("mem", src_img, size)], "sparse-src")
            dst = Peer("qmigd", "dest", [("mem", dst_img, size)], "sparse-dst")
            si, di, secs = migrate(src, dst, multifd, channels, zpd, timeout=600)
            ram = si["ram"]
            check(ram["normal"] == DATA_PAGES, ram)
            check(ram["duplicate"] == size // PAGE - DATA_PAGES, ram)
            rss = peak_rss_kib(src.proc.pid), peak_rss_kib(dst.proc.pid)
            print(f"  {size >> 40} TiB, {channels if multifd else 0} channels, zpd {zpd}: "
                  f"{secs:.1f} s; peak RSS source {rss[0] >> 10} MiB, destination "
                  f"{rss[1] >> 10} MiB", flush=True)
            check(max(rss) <= RSS_LIMIT_KIB, f"peak RSS {rss} KiB over 2 GiB")
            # Data pages equal, holes everywhere else.
            got = data_pages(dst_img, size)
            check(sorted(got) == sorted(want), f"{len(got)} data pages on the destination, "
                                               f"{len(want)} sent")
            with open(dst_img, "rb") as f:
                for off, data in want.items():
                    f.seek(off)
                    check(f.read(PAGE) == data, f"page at 0x{off:x} differs")
        finally:
            for p in (src, dst):
                if p:
                    p.stop()
            remove(src_img, dst_img)
    fn.__name__ = f"test_sparse_{size >> 40}TiB_{'multifd' + str(channels) if multifd else 'plain'}_{zpd}"
    test(fn)


sparse_cell(TiB, True, 8, "multifd")


if __name__ == "__main__":
    main()
