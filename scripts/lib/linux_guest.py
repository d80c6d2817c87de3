"""A real Linux guest for migration tests: Debian's kernel (linux-image-amd64)
with a busybox initramfs built here, on QEMU 10's q35 machine, its serial
console in a file.

The guest's init fills 32 MiB (or `fill` MiB) of its memory with random bytes and prints
their checksum once (CHECKSUM), then loops: prints a counter with its
uptime (COUNTER n seconds), rewrites 1 MiB of other memory, re-checks the
32 MiB every 20 ticks (VERIFY sum), sleeps 100 ms. A guest that migrated
well goes on counting from where it was and verifies the same sum; one
that rebooted prints CHECKSUM again and counts from 1.
"""
import glob
import os
import re
import shutil
import subprocess
import tempfile

import runner
from runner import Peer, unique_name
from waiting import wait_until

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t devtmpfs dev /dev
FILL=$(sed -n 's/.*fill=\([0-9]*\).*/\1/p' /proc/cmdline)
FILL=${FILL:-32}
mkdir -p /m && mount -t tmpfs -o size=$((FILL + 64))m tmpfs /m
dd if=/dev/urandom of=/m/pattern bs=1M count=$FILL 2>/dev/null
echo "CHECKSUM $(md5sum /m/pattern | cut -d' ' -f1)"
i=0
while true; do
  i=$((i+1))
  echo "COUNTER $i $(cut -d' ' -f1 /proc/uptime)"
  dd if=/dev/urandom of=/m/dirty bs=64k count=16 2>/dev/null
  if [ $((i % 20)) -eq 0 ]; then echo "VERIFY $(md5sum /m/pattern | cut -d' ' -f1)"; fi
  usleep 100000
done
"""

BOOT_TIMEOUT = 120  # TCG boots in 10-15 s here; generous for slower hosts


class Unavailable(Exception):
    """No kernel, busybox or cpio here: the caller skips, saying this."""


def kernel_path():
    found = sorted(glob.glob("/boot/vmlinuz-*"))
    if not found:
        raise Unavailable("no kernel in /boot (scripts/install-deps.sh installs linux-image-amd64)")
    return found[-1]


def build_initramfs(directory):
    """Writes DIR/guest.cpio.gz (busybox + init); returns its path."""
    busybox = shutil.which("busybox")
    if not busybox or not shutil.which("cpio"):
        raise Unavailable("busybox-static and cpio are needed (scripts/install-deps.sh)")
    if "statically linked" not in subprocess.run(["file", "-L", busybox], capture_output=True,
                                                 text=True).stdout:
        raise Unavailable(f"{busybox} is not the static busybox (install busybox-static)")
    root = tempfile.mkdtemp(prefix="initramfs-", dir=directory)
    try:
        os.makedirs(os.path.join(root, "bin"))
        for d in ("proc", "dev", "m"):
            os.makedirs(os.path.join(root, d))
        shutil.copy(busybox, os.path.join(root, "bin", "busybox"))
        with open(os.path.join(root, "init"), "w") as f:
            f.write(INIT)
        os.chmod(os.path.join(root, "init"), 0o755)
        out = os.path.join(directory, "guest.cpio.gz")
        subprocess.run(f"find . | cpio -o -H newc 2>/dev/null | gzip -1 > {out}", shell=True,
                       cwd=root, check=True)
        return out
    finally:
        shutil.rmtree(root)


_accel = []  # the accelerator a guest came up under, once one did
# ... remembered across processes: a KVM that cannot boot a guest (nested
# without support) prints nothing and costs the whole boot timeout, once
# per test file otherwise.
ACCEL_MEMO = os.path.join(tempfile.gettempdir(), "qmigd-guest-accel")


def _remembered_accel():
    try:
        with open(ACCEL_MEMO) as f:
            accel = f.read().strip()
    except OSError:
        return None
    return accel if accel in accelerators() else None


def accelerators():
    """KVM first where the host offers it, then TCG."""
    return (["kvm"] if os.access("/dev/kvm", os.R_OK | os.W_OK) else []) + ["tcg"]


def machine_args(initrd, serial, mem="512M", extra=None, fill=32, accel=None):
    accel = accel or (_accel[0] if _accel else accelerators()[0])
    return (["-M", "q35", "-m", mem, "-nodefaults", "-display", "none", "-accel", accel]
            + (["-cpu", "qemu64"] if accel == "kvm" else [])
            + ["-kernel", kernel_path(), "-initrd", initrd,
               "-append", f"console=ttyS0 quiet panic=-1 fill={fill}", "-serial", f"file:{serial}",
               "-no-reboot"] + (extra or []))


class SerialLog:
    """What a guest printed on its console."""

    def __init__(self, path):
        self.path = path

    def text(self):
        try:
            with open(self.path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def counters(self):
        """[(n, uptime seconds)] in the order printed."""
        return [(int(n), float(t)) for n, t in re.findall(r"COUNTER (\d+) ([\d.]+)\n", self.text())]

    def checksums(self):
        return re.findall(r"CHECKSUM ([0-9a-f]{32})", self.text())

    def verifies(self):
        return re.findall(r"VERIFY ([0-9a-f]{32})", self.text())

    def wait_for(self, pred, timeout, what):
        """Until pred(self) holds; a WaitTimeout (a TimeoutError) shows
        the end of what the guest printed instead."""
        wait_until(f"guest: {what} on {self.path}", lambda: pred(self), timeout, every=0.1,
                   seen=lambda: self.text()[-2000:])


class LinuxGuest(Peer):
    """QEMU 10 running the guest (role source), or waiting for it (role
    dest, -incoming defer). `serial` is its console log."""

    def __init__(self, role, initrd, tag, log_dir=None, mem="512M", extra=None, fill=32,
                 accel=None):
        name = unique_name(tag)
        self.serial = SerialLog(os.path.join(log_dir, name + ".serial") if log_dir
                                else runner.log_file(name, ".serial"))
        super().__init__("qemu", role, [], tag, log_dir=log_dir,
                         machine=machine_args(initrd, self.serial.path, mem, extra, fill, accel))

    def wait_booted(self, timeout=BOOT_TIMEOUT):
        """Until the guest printed its checksum and is counting."""
        def booted(s):
            if "CHECKSUM \n" in s.text():
                raise AssertionError(f"the guest could not fill its memory: {s.text()[-1000:]}")
            return s.checksums() and len(s.counters()) >= 3
        self.serial.wait_for(booted, timeout, "CHECKSUM and COUNTER lines")

    def remove_serial(self):
        try:
            os.unlink(self.serial.path)
        except OSError:
            pass


def boot(initrd, tag, log_dir=None, mem="512M", fill=32, timeout=BOOT_TIMEOUT, extra=None):
    """A running guest: under KVM where one comes up there (a nested KVM
    may print nothing), else under TCG; later guests (migration targets)
    use the same accelerator. Raises Unavailable when none boots."""
    tried = []
    first = _accel[0] if _accel else _remembered_accel()
    order = [first] + [a for a in accelerators() if a != first] if first else accelerators()
    for accel in order:
        guest = LinuxGuest("source", initrd, tag, log_dir, mem, extra=extra, fill=fill, accel=accel)
        try:
            guest.wait_booted(timeout)
            _accel[:] = [accel]
            with open(ACCEL_MEMO, "w") as f:
                f.write(accel)
            return guest
        except TimeoutError:
            tried.append(f"{accel}: {guest.serial.text()[-300:]!r}")
            guest.stop()
    raise Unavailable(f"no guest came up within {timeout} s under " + "; ".join(tried))


def continued(before, after, timeout=BOOT_TIMEOUT, checksum=None):
    """Checks that the guest whose console was `before` runs on with
    console `after`: read as one console (a line may be cut by the
    switchover), the counter goes on by ones without a reboot, and every
    VERIFY after it matches the first checksum (a VERIFY comes every 20
    ticks: a TCG guest beside other tests may take a boot's time to print
    one). Returns (last n before,
    first n after, the guest's uptime gap in seconds across the switch).
    `checksum`: the one the guest printed at boot, when `before` is a
    console after an earlier migration."""
    after.wait_for(lambda s: len(s.counters()) >= 3 and s.verifies(), timeout,
                   "COUNTER and VERIFY lines after the migration")
    head, tail = before.text(), after.text()
    counters = [(m.start(), int(m.group(1)), float(m.group(2)))
                for m in re.finditer(r"COUNTER (\d+) ([\d.]+)\n", head + tail)]
    if re.search(r"CHECKSUM", tail):
        raise AssertionError(f"the guest rebooted: {after.path} has a CHECKSUM line")
    for (_, a, _), (_, b, _) in zip(counters, counters[1:]):
        if b != a + 1:
            raise AssertionError(f"counter went {a} -> {b} ({before.path}, {after.path})")
    cut = max(i for i, c in enumerate(counters) if c[0] < len(head))
    want = checksum or before.checksums()[0]
    if any(v != want for v in after.verifies()):
        raise AssertionError(f"memory changed: VERIFY {after.verifies()} != CHECKSUM {want}")
    last, first = counters[cut], counters[cut + 1]
    return last[1], first[1], first[2] - last[2]
