#!/usr/bin/env python3
"""Side-by-side benchmark: the same RAM image migrated QEMU 10 -> QEMU 10
and qmigd -> qmigd (optionally the mixed pairs), unlimited bandwidth.
Reports wall time, CPU seconds of both processes, and ratios to QEMU.

  scripts/bench.py [--size 4G] [--channels 4] [--zpd multifd] [--content mixed]
                   [--repeat 3] [--pairs qemu:qemu,qmigd:qmigd,qemu:qmigd,qmigd:qemu]
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from runner import Peer, make_image, migrate, files_equal, remove, unique_name  # noqa: E402


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def one_run(src_kind, dst_kind, src_img, size, args):
    dst_img = f"/dev/shm/{unique_name('bench-dst')}.ram"
    src = dst = None
    try:
        src = Peer(src_kind, "source", [("mem", src_img, size)], "bench-src")
        dst = Peer(dst_kind, "dest", [("mem", dst_img, size)], "bench-dst")
        c0 = cpu_seconds(src.proc.pid) + cpu_seconds(dst.proc.pid)
        info, _, secs = migrate(src, dst, args.channels > 0, max(args.channels, 1), args.zpd)
        cpu = cpu_seconds(src.proc.pid) + cpu_seconds(dst.proc.pid) - c0
        ok = files_equal(src_img, dst_img)
        return secs, cpu, info, ok
    finally:
        for p in (src, dst):
            if p:
                p.stop()
        remove(dst_img)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4G")
    ap.add_argument("--channels", type=int, default=4, help="0 = multifd off")
    ap.add_argument("--zpd", default="multifd")
    ap.add_argument("--content", default="mixed")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pairs", default="qemu:qemu,qmigd:qmigd")
    args = ap.parse_args()
    size = parse_size(args.size)
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    src_img = f"/dev/shm/{unique_name('bench-src')}.ram"
    results = {}
    try:
        make_image(src_img, size, args.content)
        print(f"image {args.size} {args.content}, multifd channels {args.channels}, "
              f"zero-page-detection {args.zpd}, unlimited bandwidth, {args.repeat} runs each")
        for r in range(args.repeat):
            for pair in pairs:  # interleaved, so both see the same machine state
                secs, cpu, info, ok = one_run(pair[0], pair[1], src_img, size, args)
                results.setdefault(pair, []).append((secs, cpu))
                print(f"  run {r + 1} {pair[0]:>5} -> {pair[1]:<5} {secs:7.3f} s  cpu {cpu:7.3f} s  "
                      f"downtime {info.get('downtime')} ms  identical {ok}", flush=True)
                if not ok:
                    sys.exit(1)
        base = results.get(("qemu", "qemu"))
        print("median:")
        for pair, runs in results.items():
            t = statistics.median(s for s, _ in runs)
            c = statistics.median(c for _, c in runs)
            line = f"  {pair[0]:>5} -> {pair[1]:<5} time {t:7.3f} s  cpu {c:7.3f} s"
            if base:
                bt = statistics.median(s for s, _ in base)
                bc = statistics.median(c for _, c in base)
                line += f"  time ratio {t / bt:5.2f}x  cpu ratio {c / bc:5.2f}x (vs QEMU->QEMU)"
            print(line)
    finally:
        remove(src_img)


if __name__ == "__main__":
    main()
