#!/usr/bin/env python3
"""qmigd source -> QEMU 10 dest and -> qmigd dest; counters against QEMU's."""
from itest import test, main, check
from fixtures import run_cell, ODD_SIZE, MiB

CHANNELS = [(False, 0), (True, 1), (True, 2), (True, 4), (True, 8)]
ZPD = ["none", "legacy", "multifd"]


def cell(dst_kind, size, content, multifd, channels, zpd, blocks=("mem",)):
    def fn():
        run_cell("qmigd", dst_kind, size, content, multifd, channels or 2, zpd, blocks=blocks)
    fn.__name__ = (f"test_to_{dst_kind}_{size // MiB}M_{content}_"
                   f"{'multifd' + str(channels) if multifd else 'plain'}_{zpd}_{len(blocks)}blk")
    test(fn)


for dst in ("qemu", "qmigd"):
    for multifd, ch in CHANNELS:
        for zpd in ZPD:
            cell(dst, ODD_SIZE, "mixed", multifd, ch, zpd)
    for content in ("zero", "random"):
        cell(dst, ODD_SIZE, content, True, 4, "multifd")
        cell(dst, ODD_SIZE, content, False, 0, "legacy")
cell("qmigd", 64 * MiB, "mixed", True, 4, "multifd", blocks=("mem", "mem2"))
cell("qmigd", 64 * MiB, "mixed", False, 0, "legacy", blocks=("mem", "mem2"))


def same_counters(multifd, channels, zpd):
    def fn():
        a = run_cell("qemu", "qmigd", 64 * MiB, "mixed", multifd, channels, zpd)["ram"]
        b = run_cell("qmigd", "qmigd", 64 * MiB, "mixed", multifd, channels, zpd)["ram"]
        for k in ("duplicate", "normal", "normal-bytes", "total"):
            check(a[k] == b[k], f"{k}: QEMU {a[k]} qmigd {b[k]}")
        diff = abs(a["transferred"] - b["transferred"]) / a["transferred"]
        check(diff <= 0.01, f"transferred: QEMU {a['transferred']} qmigd {b['transferred']}")
        check(b["zero"] == b["duplicate"] and b["zero-bytes"] == b["zero"] * 4096, b)
    fn.__name__ = f"test_counters_like_qemu_{'multifd' + str(channels) if multifd else 'plain'}_{zpd}"
    test(fn)


for multifd, ch in [(False, 2), (True, 2), (True, 4)]:
    for zpd in ZPD:
        same_counters(multifd, ch, zpd)


if __name__ == "__main__":
    main()
