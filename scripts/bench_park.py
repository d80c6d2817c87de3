#!/usr/bin/env python3
"""Parking speed: a running q35 Linux guest (scripts/lib/linux_guest.py)
migrated QEMU 10 -> QEMU 10, QEMU 10 -> qmigd (parked in /dev/shm) and
qmigd -> QEMU 10 (resumed), interleaved, the same guest throughout (each
run's target is the next run's source), unlimited bandwidth.

Every round: QEMU -> QEMU by precopy, then by postcopy; QEMU -> park; the
parked VM resumed three times from the same directory: by precopy, by
postcopy started at once (these targets are stopped once measured; that
first postcopy resume records the pages the guest asks for in the
directory, daemon/park/working_set.h) and by postcopy again, which sends
that working set first (that target runs on). Precopy uses 4 multifd channels with zero-page-detection
multifd; postcopy the main channel (QEMU 10 refuses multifd with it) with
zero-page-detection legacy. Reports medians of: the time from `migrate`
until the target runs the guest (its query-status, polled every 2 ms),
until both sides completed (their MIGRATION events), the source's
downtime and, for postcopy, the page requests (and the pages sent as the
working set); for each switch the guest's counter gap.

  scripts/bench_park.py                  # 1 GiB guest holding 384 MiB, 3 rounds
  scripts/bench_park.py --mem 512M --fill 128 --repeat 5
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from runner import Peer, start_incoming, wait_status, completed_at  # noqa: E402
import linux_guest as lg  # noqa: E402
from qmp_args import parse_size  # noqa: E402
from charts import (WHISKERS, bar_chart, require_matplotlib, runs_words, size_words,  # noqa: E402
                    spread)  # noqa: E402


def timed(src, dst, channels, postcopy=False):
    """One migration; returns its times (s), downtime (ms) and requests."""
    multifd = channels > 0 and not postcopy
    def postcopy_ram(p, state):
        p.qmp.cmd("migrate-set-capabilities",
                  capabilities=[{"capability": "postcopy-ram", "state": state}])
    for p, zpd in ((src, "legacy" if postcopy else "multifd"), (dst, None)):
        postcopy_ram(p, False)  # a guest that came by postcopy has it on
        p.set_migration(multifd, max(channels, 1), zpd, 0, events=True)
        postcopy_ram(p, postcopy)
    port = start_incoming(dst)
    t0, wall0 = time.monotonic(), time.time()
    src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
    if postcopy:
        src.qmp.cmd("migrate-start-postcopy")
    while dst.qmp.cmd("query-status")["status"] != "running":
        if time.monotonic() - t0 > 300:
            raise RuntimeError("the target never ran the guest")
        time.sleep(0.002)
    running = time.monotonic() - t0
    si = wait_status(src, ("completed",), 300)
    wait_status(dst, ("completed",), 300)
    ends = [completed_at(p) for p in (src, dst)]
    secs = max(ends) - wall0 if None not in ends else time.monotonic() - t0
    return {"running": running, "secs": secs, "downtime": si.get("downtime", 0),
            "requests": si["ram"]["postcopy-requests"],
            "ws": si["ram"].get("x-working-set-pages", 0),
            "ws_asked": si["ram"].get("x-working-set-requested", 0)}


ROWS = ["QEMU -> QEMU", "QEMU -> QEMU (postcopy)", "QEMU -> qmigd (park)",
        "qmigd -> QEMU (resume)", "qmigd -> QEMU (resume by postcopy)",
        "qmigd -> QEMU (again by postcopy, working set first)"]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mem", default="1G")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--fill", type=int, default=384, help="MiB of random data the guest holds")
    ap.add_argument("--plot", help="write a PNG chart of the table here")
    args = ap.parse_args()
    if args.plot:
        require_matplotlib()  # now, not after the whole run
    work = tempfile.mkdtemp(prefix="qmigd-bench-park-", dir="/dev/shm")
    runs = {name: [] for name in ROWS}
    guest = None
    try:
        initrd = lg.build_initramfs(work)
        guest = lg.boot(initrd, "bpark", log_dir=work, mem=args.mem, fill=args.fill)
        checksum = guest.serial.checksums()[0]

        def new_target():
            return lg.LinuxGuest("dest", initrd, "bpark", log_dir=work, mem=args.mem,
                                 fill=args.fill)

        def record(r, name, run, before=None, target=None):
            runs[name].append(run)
            gap = ""
            if target is not None:
                last, nxt, g = lg.continued(before.serial, target.serial, checksum=checksum)
                run["gap"] = g
                gap = f"  counter {last} -> {nxt}, guest gap {g:.2f} s"
            ws = f", working set {run['ws']} pages ({run['ws_asked']} asked)" if run["ws"] else ""
            print(f"round {r + 1} {name:52} running after {run['running']:.3f} s, completed "
                  f"{run['secs']:.2f} s, downtime {run['downtime']} ms, "
                  f"{run['requests']} requests{ws}{gap}", flush=True)

        for r in range(args.repeat):
            for name, postcopy in ((ROWS[0], False), (ROWS[1], True)):
                target = new_target()
                run = timed(guest, target, args.channels, postcopy)
                guest.stop()
                record(r, name, run, guest, target)
                guest = target
            d = tempfile.mkdtemp(prefix="vm-", dir=work)
            park = Peer("qmigd", "dest", [], "bpark-dst", extra=["--ram-dir", d], log_dir=work)
            run = timed(guest, park, args.channels)
            park.stop()
            record(r, ROWS[2], run)
            for name, postcopy in ((ROWS[3], False), (ROWS[4], True), (ROWS[5], True)):
                src = Peer("qmigd", "source", [], "bpark-src", extra=["--ram-dir", d],
                           log_dir=work)
                target = new_target()
                run = timed(src, target, args.channels, postcopy)
                src.stop()
                record(r, name, run, guest, target)
                if name == ROWS[-1]:
                    guest.stop()
                    guest = target
                else:
                    target.stop()
            shutil.rmtree(d)
        print(f"\n| {args.mem} running guest holding {args.fill} MiB of random data, median of "
              f"{args.repeat} | guest runs after s | completed after s | source downtime ms | "
              f"postcopy requests | working set pages | guest counter gap s |")
        print("|---|---|---|---|---|---|---|")
        meds = {}
        for name, rs in runs.items():
            med = meds[name] = {k: statistics.median(x.get(k, 0) for x in rs)
                                for k in ("running", "secs", "downtime", "requests", "gap", "ws")}
            gap = f"{med['gap']:.2f}" if "gap" in rs[0] else "-"
            print(f"| {name} | {med['running']:.3f} | {med['secs']:.2f} | {med['downtime']:.0f} | "
                  f"{med['requests']:.0f} | {med['ws']:.0f} | {gap} |")
        if args.plot:
            bar_chart(args.plot, f"Parking and resuming a Linux guest of "
                      f"{size_words(parse_size(args.mem))} holding {args.fill} MiB of random "
                      f"data, {runs_words([args.repeat])}",
                      "seconds from migrate (lower is better)", ROWS,
                      {"the target runs the guest": [meds[n]["running"] for n in ROWS],
                       "both sides completed": [meds[n]["secs"] for n in ROWS]},
                      spreads={"the target runs the guest":
                               [spread([x["running"] for x in runs[n]]) for n in ROWS],
                               "both sides completed":
                               [spread([x["secs"] for x in runs[n]]) for n in ROWS]},
                      note=f"precopy: {args.channels} multifd channels"
                      + (f"; {WHISKERS}" if args.repeat > 1 else ""))
    finally:
        if guest:
            guest.stop()
        shutil.rmtree(work, True)


if __name__ == "__main__":
    main()
