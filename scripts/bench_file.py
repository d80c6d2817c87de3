#!/usr/bin/env python3
"""Save to and restore from a file with mapped-ram, QEMU 10 against qmigd,
side by side on the same disk (not /dev/shm: a RAM file system is no disk).

Each round saves the image with QEMU and with qmigd, then restores each
file with the same program, interleaved; times are from the command until
the migration completed. The disk's own O_DIRECT sequential write and read
rates are measured in the same run, so page data rates read as a share of
what the disk does. Every file is read once before it is restored, so that
restores read the disk and not the host's write-back cache (read_through).

  scripts/bench_file.py                         # 2G mixed, 4 channels, direct-io, 3 rounds
  scripts/bench_file.py --dir /var/tmp --size 1G --no-direct-io --channels 0
"""
import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from charts import (WHISKERS, bar_chart, fmt3, require_matplotlib, runs_words,  # noqa: E402
                    size_words, spread)  # noqa: E402
from runner import Peer, make_image, wait_status, files_equal, remove, unique_name  # noqa: E402
from qmp_args import parse_size  # noqa: E402


def read_through(path, chunk=4 << 20):
    """Reads a file once, sequentially, with O_DIRECT; returns MB/s.

    On a virtual disk the first read of data just written can come from the
    host's write-back cache: here 6.2 GB/s the first time, 1.6 GB/s the
    next (dd, 1 GiB, 4 MiB requests). Reading each saved file once before it
    is restored makes every restore read the disk, as the disk's own read
    figure does."""
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size, t = os.fstat(fd).st_size, time.monotonic()
        for off in range(0, size, chunk):
            os.preadv(fd, [buf], off)
        return size / (time.monotonic() - t) / 1e6
    finally:
        os.close(fd)


def disk_rates(directory, size=1 << 30, chunk=4 << 20):
    """Sequential O_DIRECT write, then two reads of `size` bytes: MB/s of
    (write, first read, read). The first read is the host's write-back
    cache (see read_through); the second is the disk."""
    path = os.path.join(directory, unique_name("disk") + ".tmp")
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(chunk))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        t = time.monotonic()
        for off in range(0, size, chunk):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        write = size / (time.monotonic() - t) / 1e6
        os.close(fd)
        return write, read_through(path, chunk), read_through(path, chunk)
    finally:
        remove(path)


def timed(peer, cmd, uri):
    t = time.monotonic()
    peer.qmp.cmd(cmd, uri=uri)
    info = wait_status(peer, ("completed",), timeout=600)
    return time.monotonic() - t, info


def configure(peer, channels, direct_io):
    peer.set_migration(channels > 0, max(channels, 1), None, 0, mapped_ram=True,
                       extra_params={"direct-io": direct_io} if channels else None)


def timed_peer(kind, role, img, size, channels, direct_io, cmd, uri):
    """A fresh peer runs one save or restore; its log stays only if that
    fails. Returns seconds and the final query-migrate."""
    peer = Peer(kind, role, [("mem", img, size)], f"bench-{role}")
    try:
        configure(peer, channels, direct_io)
        secs, info = timed(peer, cmd, uri)
    finally:
        peer.stop()
    remove(peer.log_path)
    return secs, info


def one_round(kind, src_img, size, directory, channels, direct_io):
    f = os.path.join(directory, unique_name(f"save-{kind}") + ".mig")
    dst_img = f"/dev/shm/{unique_name('bench-dst')}.ram"
    try:
        save, info = timed_peer(kind, "source", src_img, size, channels, direct_io, "migrate",
                                f"file:{f}")
        # The page data, as the source counts it: a writer may fill short
        # runs of zero pages too, which the file's allocated size would count.
        page_bytes = info["ram"]["normal-bytes"]
        fd = os.open(f, os.O_RDONLY)  # the main stream is buffered: drop it
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        read_through(f)
        restore, _ = timed_peer(kind, "dest", dst_img, size, channels, direct_io,
                                "migrate-incoming", f"file:{f}")
        if not files_equal(src_img, dst_img):
            sys.exit(f"{kind}: restored image differs")
        return save, restore, page_bytes
    finally:
        remove(f, dst_img)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--size", default="2G")
    ap.add_argument("--content", default="mixed")
    ap.add_argument("--channels", type=int, default=4, help="0 = multifd off")
    ap.add_argument("--no-direct-io", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--plot", help="write a PNG chart of the table here")
    args = ap.parse_args()
    if args.plot:
        require_matplotlib()  # now, not after the whole run
    size = parse_size(args.size)
    direct_io = not args.no_direct_io and args.channels > 0
    directory = tempfile.mkdtemp(prefix="qmigd-bench-file-", dir=args.dir)
    src_img = f"/dev/shm/{unique_name('bench-src')}.ram"
    try:
        make_image(src_img, size, args.content)
        wr, first, rd = disk_rates(directory)
        print(f"disk O_DIRECT: write {wr:.0f} MB/s, read {rd:.0f} MB/s (first read after "
              f"writing, from the host's cache: {first:.0f} MB/s)", flush=True)
        runs = {"qemu": [], "qmigd": []}
        for r in range(args.repeat):
            for kind in ("qemu", "qmigd"):
                save, restore, data = one_round(kind, src_img, size, directory, args.channels,
                                                direct_io)
                runs[kind].append((save, restore, data))
                print(f"  run {r + 1} {kind:>5}: save {save:6.2f} s  restore {restore:6.2f} s  "
                      f"page data {data / 1e6:.0f} MB", flush=True)
        med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in runs.items()}
        cfg = (f"{args.size} {args.content}, mapped-ram, "
               f"{'multifd ' + str(args.channels) if args.channels else 'multifd off'}"
               f"{', direct-io' if direct_io else ''}, median of {args.repeat}")
        print(f"\n| {cfg} | QEMU 10 | qmigd | qmigd / QEMU |\n|---|---|---|---|")
        for i, what, disk in ((0, "save", wr), (1, "restore", rd)):
            q, m = med["qemu"][i], med["qmigd"][i]
            mbq, mbm = med["qemu"][2] / q / 1e6, med["qmigd"][2] / m / 1e6
            print(f"| {what} s (MB/s of page data, % of disk) | {q:.2f} ({mbq:.0f}, "
                  f"{100 * mbq / disk:.0f}%) | {m:.2f} ({mbm:.0f}, {100 * mbm / disk:.0f}%) "
                  f"| {m / q:.2f}x |")
        if args.plot:
            words = (f"a {size_words(size)} image of {args.content} pages, mapped-ram, "
                     f"{str(args.channels) + ' channels' if args.channels else 'no multifd'}"
                     f"{', direct-io' if direct_io else ''}, {runs_words([args.repeat])}")
            bar_chart(args.plot, f"Saving to and restoring from a file: {words}",
                      "seconds (lower is better)", ["save", "restore"],
                      {"QEMU 10": med["qemu"][:2], "qmigd": med["qmigd"][:2]},
                      spreads={"QEMU 10": [spread([x[i] for x in runs["qemu"]]) for i in (0, 1)],
                               "qmigd": [spread([x[i] for x in runs["qmigd"]]) for i in (0, 1)]},
                      note=f"disk O_DIRECT: write {fmt3(wr)} MB/s, read {fmt3(rd)} MB/s"
                      + (f"; {WHISKERS}" if args.repeat > 1 else ""))
    finally:
        remove(src_img)
        for name in os.listdir(directory):
            remove(os.path.join(directory, name))
        os.rmdir(directory)


if __name__ == "__main__":
    main()
