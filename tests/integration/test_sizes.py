#!/usr/bin/env python3
"""One size rule: tests/data/qemu-sizes.json is what QEMU 10's qemu_strtosz
makes of each string, asked of the installed QEMU now (so the table stays
true), and qmig's parser reads each the same (the C++ one: the unit tests,
from the same table)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "lib"))
from itest import test, main, check  # noqa: E402
from qmp_args import parse_size  # noqa: E402
import qemu_sizes  # noqa: E402

TABLE = os.path.join(os.path.dirname(__file__), "..", "data", "qemu-sizes.json")


def checked_in():
    with open(TABLE) as f:
        return json.load(f)


@test
def test_the_table_is_qemu_10s_own():
    want = checked_in()
    check(list(want) == qemu_sizes.STRINGS, "the table's strings are qemu_sizes.STRINGS: "
          "write it anew (python3 tests/integration/qemu_sizes.py)")
    got = qemu_sizes.table()
    diff = {s: (want[s], got[s]) for s in want if want[s] != got[s]}
    check(not diff, f"checked in vs QEMU now: {diff}")


@test
def test_qmig_reads_each_size_as_qemu_10():
    diff = {}
    for text, want in checked_in().items():
        try:
            got = parse_size(text)
        except ValueError:
            got = None
        if got != want:
            diff[text] = (want, got)
    check(not diff, f"QEMU 10 vs qmig: {diff}")
    check(parse_size("1.5", 20) == 3 << 19, "the MiB default (max-bandwidth) takes 1.5")


if __name__ == "__main__":
    main()
