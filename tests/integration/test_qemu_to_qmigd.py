#!/usr/bin/env python3
"""QEMU 10 source -> qmigd dest: byte-identical images across the grid."""
from itest import test, main, check
from fixtures import run_cell, ODD_SIZE, MiB

GiB = 1024 * MiB
CHANNELS = [(False, 0), (True, 1), (True, 2), (True, 4), (True, 8)]
ZPD = ["none", "legacy", "multifd"]


def cell(size, content, multifd, channels, zpd, dest="fresh"):
    def fn():
        info = run_cell("qemu", "qmigd", size, content, multifd, channels or 2, zpd, dest)
        check(info["ram"]["total"] == size)
    fn.__name__ = (f"test_{size // MiB}M_{content}_{'multifd' + str(channels) if multifd else 'plain'}"
                   f"_{zpd}_{dest}")
    test(fn)


# Every channel configuration x every zero-page mode, odd size, mixed content.
for multifd, ch in CHANNELS:
    for zpd in ZPD:
        cell(ODD_SIZE, "mixed", multifd, ch, zpd)
# Contents, odd size.
for content in ("zero", "random"):
    cell(ODD_SIZE, content, True, 4, "multifd")
    cell(ODD_SIZE, content, False, 0, "legacy")
# A destination image full of garbage: zero pages must overwrite it.
for multifd, ch in CHANNELS:
    cell(ODD_SIZE, "mixed", multifd, ch, "multifd", dest="garbage")
cell(ODD_SIZE, "zero", True, 2, "multifd", dest="garbage")
# 1 GiB images.
cell(GiB, "mixed", True, 4, "multifd")
cell(GiB, "mixed", True, 8, "legacy")
cell(GiB, "random", False, 0, "none")
cell(GiB, "zero", True, 2, "multifd", dest="garbage")


if __name__ == "__main__":
    main()
