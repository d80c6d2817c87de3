#!/usr/bin/env python3
"""What zero-copy-send and xbzrle buy, and what the sandbox costs, each
against the same run without it, interleaved, on this machine.

zero-copy-send: an image (default 2 GiB, mixed) migrated over loopback TCP
with 4 multifd channels, unlimited bandwidth, QEMU 10 -> QEMU 10 and
qmigd -> qmigd, with and without the capability on the source.

sandbox: the zero-copy runs' image and channels, QEMU 10 -> QEMU 10 and
qmigd -> qmigd, both sides unconfined and both confined (qmigd --sandbox on;
QEMU -sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,
resourcecontrol=deny).

xbzrle: a qmigd source with a workload rewriting a few bytes of pages in a
hot set (`qmigd guest --write-bytes`), at a limited bandwidth, migrated to
QEMU 10 and to qmigd with and without xbzrle (main channel, zero-page
detection legacy: QEMU refuses xbzrle with multifd).

Reports medians of wall time (migrate until both completed; inf: an xbzrle
run that had not converged by --timeout, then cancelled), CPU seconds of
both processes, and the bytes on the wire (query-migrate's transferred).

  scripts/bench_caps.py                          # both, 3 rounds
  scripts/bench_caps.py --only zero-copy --size 4G --repeat 5
  scripts/bench_caps.py --only sandbox --repeat 5
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from runner import (Guest, Peer, make_image, migrate, files_equal, remove,  # noqa: E402
                    unique_name, start_incoming, wait_status)
from qmp_args import parse_size  # noqa: E402

MiB = 1 << 20
NAMES = {"qemu": "QEMU", "qmigd": "qmigd"}


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def caps(peer, **states):
    peer.qmp.cmd("migrate-set-capabilities",
                 capabilities=[{"capability": k.replace("_", "-"), "state": v}
                               for k, v in states.items()])


def sandbox_args(kind, on):
    """Both sides confined the way each offers it, or not at all."""
    if not on:
        return ["--sandbox", "off"] if kind == "qmigd" else []
    return ["--sandbox", "on"] if kind == "qmigd" else [
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]


def multifd_run(pair, src_img, size, zero_copy=False, sandbox=False):
    dst_img = f"/dev/shm/{unique_name('bench-dst')}.ram"
    src = dst = None
    try:
        src = Peer(pair[0], "source", [("mem", src_img, size)], "zc-src",
                   sandbox_args(pair[0], sandbox))
        dst = Peer(pair[1], "dest", [("mem", dst_img, size)], "zc-dst",
                   sandbox_args(pair[1], sandbox))
        pids = (src.proc.pid, dst.proc.pid)
        c0 = sum(cpu_seconds(p) for p in pids)
        src.set_migration(True, 4, "multifd")
        caps(src, zero_copy_send=zero_copy)
        info, _, secs = migrate(src, dst, True, 4, "multifd", events=True)
        cpu = sum(cpu_seconds(p) for p in pids) - c0
        ok = files_equal(src_img, dst_img)
        return {"secs": secs, "cpu": cpu, "wire": info["ram"]["transferred"], "ok": ok,
                "missed": info["ram"].get("dirty-sync-missed-zero-copy", 0)}
    finally:
        for p in (src, dst):
            if p:
                p.stop()
        remove(dst_img)


def xbzrle_run(dst_kind, size, on, bandwidth, rate, timeout):
    src_img = f"/dev/shm/{unique_name('bench-src')}.ram"
    dst_img = f"/dev/shm/{unique_name('bench-dst')}.ram"
    make_image(src_img, size, "mixed")
    src = dst = guest = None
    try:
        src = Peer("qmigd", "source", [("mem", src_img, size)], "xb-src")
        dst = Peer(dst_kind, "dest", [("mem", dst_img, size)], "xb-dst")
        guest = Guest(src_img, rate=rate, pattern="hot", hot_set=32 * MiB, write_bytes=64)
        pids = (src.proc.pid, dst.proc.pid)
        c0 = sum(cpu_seconds(p) for p in pids)
        caps(src, xbzrle=on)
        src.qmp.cmd("migrate-set-parameters", {"max-bandwidth": bandwidth,
                                               "zero-page-detection": "legacy"})
        t0 = time.monotonic()
        src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{start_incoming(dst)}")
        try:
            info = wait_status(src, ("completed",), timeout)
        except TimeoutError:
            # The guest rewrites its hot set faster than whole pages cross.
            info = src.status()
            cpu = sum(cpu_seconds(p) for p in pids) - c0
            src.qmp.cmd("migrate_cancel")
            wait_status(src, ("cancelled",), 30, fail_on=("failed",))
            return {"secs": float("inf"), "cpu": cpu, "wire": info["ram"]["transferred"],
                    "ok": None, "syncs": info["ram"]["dirty-sync-count"],
                    "xpages": info.get("xbzrle-cache", {}).get("pages", 0), "downtime": 0}
        wait_status(dst, ("completed",), 60)
        secs = time.monotonic() - t0
        cpu = sum(cpu_seconds(p) for p in pids) - c0
        ok = files_equal(src_img, dst_img)
        x = info.get("xbzrle-cache", {})
        return {"secs": secs, "cpu": cpu, "wire": info["ram"]["transferred"], "ok": ok,
                "syncs": info["ram"]["dirty-sync-count"], "xpages": x.get("pages", 0),
                "downtime": info.get("downtime", 0)}
    finally:
        if guest:
            guest.stop()
        for p in (src, dst):
            if p:
                p.stop()
        remove(src_img, dst_img)


def med(runs, key):
    return statistics.median(r[key] for r in runs)


def report(title, results, extra):
    print(f"\n{title}")
    print("| run | time s | CPU s | wire MiB |" + "".join(f" {h} |" for h, _ in extra))
    print("|---|---|---|---|" + "---|" * len(extra))
    for name, runs in results.items():
        print(f"| {name} | {med(runs, 'secs'):.2f} | {med(runs, 'cpu'):.2f} | "
              f"{med(runs, 'wire') / MiB:.0f} |" + "".join(f" {f(runs)} |" for _, f in extra))


def on_off_rounds(what, size, args):
    """zero-copy or sandbox, off then on, QEMU -> QEMU and qmigd -> qmigd,
    interleaved, over one mixed image; prints the medians."""
    src_img = f"/dev/shm/{unique_name('bench-src')}.ram"
    make_image(src_img, size, "mixed")
    results = {}
    try:
        for r in range(args.repeat):
            for pair in (("qemu", "qemu"), ("qmigd", "qmigd")):
                for on in (False, True):
                    opts = {"zero_copy" if what == "zero-copy" else "sandbox": on}
                    run = multifd_run(pair, src_img, size, **opts)
                    name = f"{NAMES[pair[0]]} -> {NAMES[pair[1]]} {what} {'on' if on else 'off'}"
                    results.setdefault(name, []).append(run)
                    print(f"  {name} run {r + 1}: {run['secs']:.3f} s, cpu {run['cpu']:.2f} s, "
                          f"missed {run['missed']}, identical {run['ok']}", flush=True)
                    if not run["ok"]:
                        sys.exit("images differ")
    finally:
        remove(src_img)
    extra = ([("syncs all copied", lambda runs: f"{med(runs, 'missed'):.0f}")]
             if what == "zero-copy" else [])
    report(f"{what}, {args.size} mixed, 4 multifd channels, loopback TCP", results, extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["zero-copy", "sandbox", "xbzrle"])
    ap.add_argument("--size", default="2G", help="zero-copy image size")
    ap.add_argument("--xbzrle-size", default="256M")
    ap.add_argument("--bandwidth", default="32M", help="xbzrle runs' max-bandwidth")
    ap.add_argument("--rate", type=int, default=20000,
                    help="xbzrle guest pages written per second")
    ap.add_argument("--timeout", type=float, default=60,
                    help="an xbzrle run that has not converged by then is cancelled (time inf)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    size_of = parse_size

    for what in ("zero-copy", "sandbox"):
        if args.only in (None, what):
            on_off_rounds(what, size_of(args.size), args)

    if args.only in (None, "xbzrle"):
        size, bw = size_of(args.xbzrle_size), size_of(args.bandwidth)
        results = {}
        for r in range(args.repeat):
            for dst in ("qemu", "qmigd"):
                for on in (False, True):
                    run = xbzrle_run(dst, size, on, bw, args.rate, args.timeout)
                    name = f"qmigd -> {NAMES[dst]} xbzrle {'on' if on else 'off'}"
                    results.setdefault(name, []).append(run)
                    print(f"  {name} run {r + 1}: {run['secs']:.3f} s, cpu {run['cpu']:.2f} s, "
                          f"wire {run['wire'] / MiB:.0f} MiB, syncs {run['syncs']}, "
                          f"xbzrle pages {run['xpages']}, identical {run['ok']}", flush=True)
                    if run["ok"] is False:
                        sys.exit("images differ")
        report(f"xbzrle, {args.xbzrle_size} mixed, a guest changing 64 bytes of pages in a "
               f"32 MiB hot set at {args.rate} pages/s, max-bandwidth {args.bandwidth}/s", results,
               [("dirty syncs", lambda runs: f"{med(runs, 'syncs'):.0f}"),
                ("xbzrle pages", lambda runs: f"{med(runs, 'xpages'):.0f}"),
                ("downtime ms", lambda runs: f"{med(runs, 'downtime'):.0f}")])


if __name__ == "__main__":
    main()
