"""What QEMU 10's qemu_strtosz makes of size strings, asked of QEMU itself:
tests/data/qemu-sizes.json is this table, checked in for the unit tests
(C++ and Python) and checked against the installed QEMU by test_sizes.py.
`python3 tests/integration/qemu_sizes.py > tests/data/qemu-sizes.json`
writes it anew.

QEMU reads `-object memory-backend-file,size=S` with qemu_strtosz; a size
it refuses says "expects a size value"; one it takes is its `size`
property (qom-get), or the value in the backend's refusal of 0 ("doesn't
take value '0'"), or, where a RAM backend of that size cannot be made, the
value in its error about the file."""
import json
import os
import re
import subprocess
import sys

# Each string: what the issue reports, and the edges of each step of
# do_strtosz (blanks, sign, hex, fraction rounding, units, overflow). A
# size QEMU takes must be one it can show: mappable, or a multiple of 4 KiB
# (the file backend's error names it page-aligned).
STRINGS = [
    "0", "1", "4096", " 1K", "\t2M", "+1K", "-1", "-0", "-1K", "1K ", "1 K", "",
    "0x10", "0X1f", "0x10M", "0x10B", "0x", "0x-1", "0x 10", "0x1_0", "0x1.8", "-0x10",
    "0xfffffffffffff000", "0x10000000000000000",
    "1.5", "1.5B", "1.0B", "1.", "1.k", "1.e", "1.5K", ".5K", " .5K", "+.5K", "-.5K", ".5",
    "1.9999K", "1.99999999999999999999K", "0.0005K", "0.00048828125K", "0.000244140625K",
    "0.0001K", "1.00048828125K", "0.5", "0.49B", "1.5e", "1.5E", "2.5G", "0.3M",
    "1e3", "1E", "inf", "nan", "infinity", "1.5k", "1b", "1kB", "1KiB", "١", "１",
    "16E", "15E", "15.5E", "16383P", "16384P", "8191P", "16777216T", "16777215T",
    "18446744073709547520", "18446744073709551616", "99999999999999999999", "1_000", "0x1p3", ".", "K", "1.5.K", "1..5K",
]

PROBE = "/dev/shm/qmigd-size-probe-" + str(os.getpid())


def qemu_answer(size, backend):
    cmds = ('{"execute": "qmp_capabilities"}\n'
            '{"execute": "qom-get", "arguments": {"path": "/objects/m", "property": "size"}}\n'
            '{"execute": "quit"}\n')
    obj = (f"memory-backend-ram,id=m,size={size}" if backend == "ram" else
           f"memory-backend-file,id=m,size={size},mem-path={PROBE},share=on")
    return subprocess.run(["qemu-system-x86_64", "-M", "none", "-nodefaults", "-display", "none",
                           "-object", obj, "-qmp", "stdio"], input=cmds, capture_output=True,
                          text=True, timeout=60)


def qemu_strtosz(size):
    """QEMU's value of `size`, or None if it refuses it."""
    r = qemu_answer(size, "ram")
    if "expects a size value" in r.stderr:
        return None
    m = re.search(r"doesn't take value '(\d+)'", r.stderr)  # the backend's "not 0"
    if m:
        return int(m.group(1))
    for line in r.stdout.splitlines():
        ret = json.loads(line).get("return")
        if isinstance(ret, int):
            return ret
    # Too large to map: a 4 KiB file's backend names the size it read.
    with open(PROBE, "wb") as f:
        f.truncate(4096)
    try:
        r = qemu_answer(size, "file")
    finally:
        os.unlink(PROBE)
    m = re.search(r"'size' option (0x[0-9a-f]+)", r.stderr)
    if m and int(m.group(1), 16) % 4096 == 0:
        return int(m.group(1), 16)
    raise RuntimeError(f"QEMU's answer to size={size!r} names no size: {r.stderr.strip()}")


def table():
    return {s: qemu_strtosz(s) for s in STRINGS}


if __name__ == "__main__":
    json.dump(table(), sys.stdout, indent=1, ensure_ascii=False)
    print()
