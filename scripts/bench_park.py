#!/usr/bin/env python3
"""Parking speed: a running q35 Linux guest (scripts/lib/linux_guest.py)
migrated QEMU 10 -> QEMU 10, QEMU 10 -> qmigd (parked in /dev/shm) and
qmigd -> QEMU 10 (resumed), interleaved, the same guest throughout (each
run's target is the next run's source), unlimited bandwidth, 4 multifd
channels, zero-page-detection multifd. Reports medians of wall time
(migrate until both sides completed, by their MIGRATION events) and of the
source's downtime, and for each switch the guest's counter gap.

  scripts/bench_park.py                  # 1 GiB guest, 3 rounds
  scripts/bench_park.py --mem 512M --repeat 5
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from runner import Peer, migrate  # noqa: E402
import linux_guest as lg  # noqa: E402


def timed(src, dst, channels):
    si, di, secs = migrate(src, dst, channels > 0, max(channels, 1), "multifd", events=True)
    return {"secs": secs, "downtime": si.get("downtime", 0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mem", default="1G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--fill", type=int, default=512, help="MiB of random data the guest holds")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="qmigd-bench-park-", dir="/dev/shm")
    runs = {"QEMU -> QEMU": [], "QEMU -> qmigd (park)": [], "qmigd -> QEMU (resume)": []}
    guest = None
    try:
        initrd = lg.build_initramfs(work)
        guest = lg.boot(initrd, "bpark", log_dir=work, mem=args.mem, fill=args.fill)
        checksum = guest.serial.checksums()[0]

        def check_on(before, g):
            last, nxt, gap = lg.continued(before.serial, g.serial, checksum=checksum)
            return f"counter {last} -> {nxt}, guest gap {gap:.2f} s"

        for r in range(args.repeat):
            target = lg.LinuxGuest("dest", initrd, "bpark", log_dir=work, mem=args.mem, fill=args.fill)
            run = timed(guest, target, args.channels)
            guest.stop()
            runs["QEMU -> QEMU"].append(run)
            print(f"round {r + 1} QEMU -> QEMU   {run['secs']:.2f} s downtime {run['downtime']} ms"
                  f"  {check_on(guest, target)}", flush=True)
            guest = target
            d = tempfile.mkdtemp(prefix="vm-", dir=work)
            park = Peer("qmigd", "dest", [], "bpark-dst", extra=["--ram-dir", d], log_dir=work)
            run = timed(guest, park, args.channels)
            park.stop()
            runs["QEMU -> qmigd (park)"].append(run)
            print(f"round {r + 1} QEMU -> park   {run['secs']:.2f} s downtime {run['downtime']} ms",
                  flush=True)
            src = Peer("qmigd", "source", [], "bpark-src", extra=["--ram-dir", d], log_dir=work)
            target = lg.LinuxGuest("dest", initrd, "bpark", log_dir=work, mem=args.mem, fill=args.fill)
            run = timed(src, target, args.channels)
            src.stop()
            guest.stop()
            runs["qmigd -> QEMU (resume)"].append(run)
            print(f"round {r + 1} park -> QEMU   {run['secs']:.2f} s downtime {run['downtime']} ms"
                  f"  {check_on(guest, target)}", flush=True)
            guest = target
            shutil.rmtree(d)
        base = statistics.median(x["secs"] for x in runs["QEMU -> QEMU"])
        print(f"\n| {args.mem} running guest holding {args.fill} MiB of random data, mf{args.channels}, median of {args.repeat} | time s | "
              f"ratio to QEMU -> QEMU | source downtime ms |")
        print("|---|---|---|---|")
        for name, rs in runs.items():
            t = statistics.median(x["secs"] for x in rs)
            dt = statistics.median(x["downtime"] for x in rs)
            print(f"| {name} | {t:.2f} | {t / base:.2f}x | {dt:.0f} |")
    finally:
        if guest:
            guest.stop()
        shutil.rmtree(work, True)


if __name__ == "__main__":
    main()
