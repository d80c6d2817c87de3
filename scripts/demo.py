#!/usr/bin/env python3
"""Runs one migration of a 1 GiB mixed image and shows the result."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from runner import Peer, make_image, migrate, files_equal, remove, unique_name  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--qemu-source", action="store_true", help="use QEMU 10 as the source")
ap.add_argument("--size", type=int, default=1 << 30)
ap.add_argument("--channels", type=int, default=4)
args = ap.parse_args()

src_img = f"/dev/shm/{unique_name('demo-src')}.ram"
dst_img = f"/dev/shm/{unique_name('demo-dst')}.ram"
src = dst = None
try:
    print(f"writing a {args.size >> 20} MiB mixed-content RAM image ...", flush=True)
    make_image(src_img, args.size, "mixed")
    src = Peer("qemu" if args.qemu_source else "qmigd", "source", [("mem", src_img, args.size)], "demo-src")
    dst = Peer("qmigd", "dest", [("mem", dst_img, args.size)], "demo-dst")

    tty = sys.stdout.isatty()
    last = [0.0]

    def progress(info):
        ram = info.get("ram")
        now = time.monotonic()
        if not ram or not ram["total"] or (not tty and now - last[0] < 1.0):
            return
        last[0] = now
        done = 100.0 * (1 - ram["remaining"] / ram["total"])
        line = f"  {info['status']:<10} {done:5.1f}%  {ram['mbps']:8.1f} mbps"
        print("\r" + line if tty else line, end="" if tty else "\n", flush=True)

    print(f"migrating {src.kind} source -> qmigd dest, multifd {args.channels} channels, "
          f"zero-page-detection multifd", flush=True)
    _, _, secs = migrate(src, dst, True, args.channels, "multifd", progress=progress)
    print(f"\ncompleted in {secs:.2f} s\n")
    print("=== source: info migrate ===")
    print(src.qmp.hmp("info migrate").replace("\r\n", "\n"))
    print("=== destination: info migrate ===")
    print(dst.qmp.hmp("info migrate").replace("\r\n", "\n"))
    same = files_equal(src_img, dst_img)
    print("images identical:", "yes" if same else "NO")
    sys.exit(0 if same else 1)
finally:
    for p in (src, dst):
        if p:
            p.stop()
    remove(src_img, dst_img)
