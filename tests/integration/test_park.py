#!/usr/bin/env python3
"""Parking a running VM: a q35 Linux guest (Debian's kernel, a busybox
initramfs built here) runs in QEMU 10 and migrates live, dirtying memory,
to a qmigd destination that parks it in a directory (no QEMU on that side);
the first QEMU goes; qmigd later migrates the parked VM to a new QEMU 10,
where the guest counts on without a reboot and re-verifies the checksum of
memory it filled before the first migration. Also: a parked VM resumed
twice (a checkpoint), parked VMs relayed qmigd -> qmigd (both parks with
a return path: the source waits for SHUT before it closes the stream), and
broken directories and streams refused, the directory untouched.

KVM where a guest comes up under it, TCG otherwise; skipped, saying why,
where no kernel or busybox is installed or no guest boots within 120 s.

By postcopy too: a guest that dirties memory faster than max-bandwidth
lets precopy converge is parked by postcopy, and parked VMs resume by
postcopy started at once -- the new QEMU runs the guest before its RAM
is there and fetches the pages it touches from qmigd."""
import atexit
import hashlib
import os
import shutil
import subprocess
import tempfile
import time

from itest import test, main, check, skip
from runner import Peer, migrate, wait_status, start_incoming, unique_name, stop_all, QMIGD
from waiting import wait_until
import linux_guest as lg

WORK = tempfile.mkdtemp(prefix="qmigd-park-", dir="/dev/shm")
atexit.register(shutil.rmtree, WORK, True)
_parked = {}  # the VM parked once per run: {"dir", "serial", "initrd"}


def initrd():
    if "initrd" not in _parked:
        try:
            lg.kernel_path()
            _parked["initrd"] = lg.build_initramfs(WORK)
        except lg.Unavailable as why:
            skip(str(why))
    return _parked["initrd"]


def new_dir(tag):
    return tempfile.mkdtemp(prefix=tag + "-", dir=WORK)


def park_peer(tag, directory):
    return Peer("qmigd", "dest", [], tag, extra=["--ram-dir", directory])


def resume_peer(tag, directory):
    return Peer("qmigd", "source", [], tag, extra=["--ram-dir", directory])


def with_return_path(*peers):
    for p in peers:
        p.qmp.cmd("migrate-set-capabilities",
                  capabilities=[{"capability": "return-path", "state": True}])


WORKING_SET = "working-set.bin"


def snapshot(directory):
    """What must not change: every file's name, size and mtime, and the
    small files' bytes (but the working set a postcopy resume records)."""
    out = {}
    for name in sorted(set(os.listdir(directory)) - {WORKING_SET}):
        path = os.path.join(directory, name)
        st = os.stat(path)
        digest = None
        if st.st_size < 1 << 20:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        out[name] = (st.st_size, st.st_mtime_ns, digest)
    return out


def parked_vm():
    """A running guest parked once (live, 4 multifd channels); later tests
    resume or copy it. Returns (directory, the first guest's console)."""
    if "dir" in _parked:
        return _parked["dir"], _parked["serial"]
    if "unavailable" in _parked:
        skip(_parked["unavailable"])
    if "failed" in _parked:
        raise AssertionError(f"parking the guest failed earlier: {_parked['failed']}")
    rd = initrd()
    guest = park = None
    try:
        try:
            guest = lg.boot(rd, "park-guest", log_dir=WORK)
        except lg.Unavailable as why:
            _parked["unavailable"] = str(why)
            skip(str(why))
        d = new_dir("vm")
        park = park_peer("park-dst", d)
        # With a return path: the source waits for SHUT before it closes, so
        # the park must find the end of a q35 device state by itself.
        with_return_path(guest, park)
        si, di, secs = migrate(guest, park, True, 4, "multifd")
        check(si["status"] == "completed" and di["status"] == "completed", (si, di))
        parked = di["parked"]
        ids = [b["id"] for b in parked["blocks"]]
        check(ids[0] == "pc.ram" and parked["blocks"][0]["size"] == 512 << 20, parked)
        check("pc.bios" in ids and parked["machine-type"] == "pc-q35-10.0", parked)
        check(parked["device-state-bytes"] > 1000, parked)
        hmp = park.qmp.cmd("human-monitor-command", **{"command-line": "info migrate"})
        check(f"parked in: {d} (pc-q35-10.0)" in hmp and "parked block: pc.ram 524288 kbytes"
              in hmp, hmp)
        print(f"  parked a running guest in {secs:.2f} s (QEMU downtime {si.get('downtime')} ms, "
              f"{len(ids)} RAM blocks, {parked['device-state-bytes']} bytes of device state)")
        _parked.update(dir=d, serial=guest.serial)
        return d, guest.serial
    except AssertionError as e:
        _parked["failed"] = e
        raise
    finally:
        stop_all(guest, park)


def resume_into_qemu(directory, tag, multifd=True, zpd="multifd", extra=None):
    """qmigd --ram-dir directory -> a new QEMU; returns that guest's console
    and the source's query-migrate."""
    src = guest = None
    try:
        src = resume_peer(tag + "-src", directory)
        guest = lg.LinuxGuest("dest", initrd(), tag, log_dir=WORK, extra=extra)
        si, di, secs = migrate(src, guest, multifd, 4, zpd)
        check(si["status"] == "completed" and di["status"] == "completed", (si, di))
        check(guest.qmp.cmd("query-status")["status"] == "running", "target not running")
        first = _parked["serial"]
        last_n, first_n, gap = lg.continued(first, guest.serial)
        print(f"  resumed in {secs:.2f} s (downtime {si['downtime']} ms): counter {last_n} -> "
              f"{first_n}, guest uptime gap {gap:.2f} s, checksum {first.checksums()[0]} "
              f"verified {len(guest.serial.verifies())}x")
        return guest.serial, si
    finally:
        stop_all(src, guest)


@test
def test_qemu_park_then_resume_twice():
    d, _ = parked_vm()
    before = snapshot(d)
    resume_into_qemu(d, "resume1")
    resume_into_qemu(d, "resume2", multifd=False, zpd="legacy")  # the same checkpoint again
    check(snapshot(d) == before, "the parked VM's directory changed")


POSTCOPY = [{"capability": "postcopy-ram", "state": True}]


PREEMPT = [{"capability": "postcopy-preempt", "state": True}]


def resume_by_postcopy(directory, tag, before, preempt=False):
    """qmigd --ram-dir directory -> a new QEMU by postcopy, started right
    after `migrate`: the guest whose console was `before` runs on. With
    preempt, the pages it asks for come on the preempt channel."""
    src = guest = None
    try:
        src = resume_peer(tag + "-src", directory)
        guest = lg.LinuxGuest("dest", initrd(), tag, log_dir=WORK)
        for p in (src, guest):
            p.qmp.cmd("migrate-set-capabilities",
                      capabilities=POSTCOPY + (PREEMPT if preempt else []))
        port = start_incoming(guest)
        t0 = time.monotonic()
        src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        src.qmp.cmd("migrate-start-postcopy")
        # Polled every 2 ms: t_run, printed, is when the target ran the guest.
        wait_until("the target to run the guest",
                   lambda: guest.qmp.cmd("query-status")["status"] == "running", every=0.002)
        t_run = time.monotonic() - t0
        si = wait_status(src, ("completed",), 120)
        t_done = time.monotonic() - t0
        wait_status(guest, ("completed",), 120)
        check(si["ram"]["postcopy-requests"] > 0 or si["ram"]["x-working-set-pages"] > 0,
              f"the guest asked for no page: {si}")
        last_n, first_n, gap = lg.continued(before, guest.serial)
        check(("preempt channel connected" in src.log_text()) == preempt, "preempt channel")
        print(f"  resumed by postcopy{' with preempt' if preempt else ''}: running after {t_run:.3f} s, completed after "
              f"{t_done:.2f} s, {si['ram']['postcopy-requests']} page requests; counter "
              f"{last_n} -> {first_n}, guest uptime gap {gap:.2f} s; working set "
              f"{si['ram']['x-working-set-pages']} pages, {si['ram']['x-working-set-requested']} "
              f"of them asked for")
        return guest.serial, si
    finally:
        stop_all(src, guest)


@test
def test_resume_by_postcopy():
    d, serial = parked_vm()
    before = snapshot(d)
    _, first = resume_by_postcopy(d, "pc-resume", serial)
    # The first resume recorded what the guest asked for; the second sends
    # it first, and the guest asks for far fewer pages.
    check(os.path.exists(os.path.join(d, WORKING_SET)), os.listdir(d))
    _, second = resume_by_postcopy(d, "pc-resume-again", serial)
    check(second["ram"]["x-working-set-pages"] > 0, second["ram"])
    print(f"  postcopy requests: {first['ram']['postcopy-requests']} on the first resume, "
          f"{second['ram']['postcopy-requests']} on the second")
    resume_by_postcopy(d, "pc-resume-preempt", serial, preempt=True)
    check(snapshot(d) == before, "the parked VM's directory changed")


@test
def test_park_by_postcopy_when_precopy_cannot_converge():
    """The guest rewrites 1 MiB every tick (10 MiB/s); at 1 MiB/s precopy
    can never catch up. Postcopy parks it: the device state comes in the
    package, the rest of RAM after; the parked VM then resumes by postcopy."""
    guest = park = None
    d = new_dir("pc-vm")
    try:
        try:
            guest = lg.boot(initrd(), "pc-park-guest", log_dir=WORK)
        except lg.Unavailable as why:
            skip(str(why))
        park = park_peer("pc-park", d)
        for p in (guest, park):
            p.qmp.cmd("migrate-set-capabilities", capabilities=POSTCOPY)
        guest.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 1 << 20})
        port = start_incoming(park)
        guest.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        # Precopy under way while the guest runs on and dirties its memory:
        # ten more ticks on its console (each rewrites 1 MiB), and RAM on
        # the wire. 512 MiB at 1 MiB/s: precopy is then far from done.
        wait_status(guest, ("active",))
        ticks = len(guest.serial.counters())
        guest.serial.wait_for(lambda s: len(s.counters()) >= ticks + 10, lg.BOOT_TIMEOUT,
                              "10 more COUNTER lines while precopy runs")

        def sending():
            info = guest.status()
            return info if info.get("ram", {}).get("transferred") else None
        info = wait_until("precopy to send RAM", sending)
        check(info["status"] == "active", info)
        guest.qmp.cmd("migrate-start-postcopy")
        si = wait_status(guest, ("completed",), 120)
        di = wait_status(park, ("completed",), 120)
        check(di["parked"]["device-state-bytes"] > 1000, di)
        print(f"  parked by postcopy: {info['ram']['remaining'] >> 20} MiB left of the first "
              f"precopy pass; downtime {si['downtime']} ms, "
              f"{si['ram']['postcopy-bytes'] >> 20} MiB after the switch")
        serial = guest.serial
    finally:
        stop_all(guest, park)
    resume_by_postcopy(d, "pc-parked-resume", serial)


@test
def test_park_relayed_qmigd_to_qmigd():
    d, _ = parked_vm()
    d2 = new_dir("relay")
    src = dst = None
    try:
        src = resume_peer("relay-src", d)
        dst = park_peer("relay-dst", d2)
        with_return_path(src, dst)
        si, di, _ = migrate(src, dst, True, 2, "multifd")
        check(si["status"] == "completed" and di["status"] == "completed", (si, di))
    finally:
        stop_all(src, dst)
    for name in os.listdir(d):  # the same VM, byte for byte (a working set stays local)
        if name not in ("vm.json", WORKING_SET):
            with open(os.path.join(d, name), "rb") as a, open(os.path.join(d2, name), "rb") as b:
                check(a.read() == b.read(), f"{name} differs after the relay")
    resume_into_qemu(d2, "relayed")


def copy_parked(tag):
    d, _ = parked_vm()
    c = new_dir(tag)
    for name in os.listdir(d):
        shutil.copy(os.path.join(d, name), c)
    return c


def start_fails(args, want):
    qmp = os.path.join("/tmp", unique_name("park-bad") + ".qmp")
    r = subprocess.run([QMIGD] + args + ["--qmp", qmp], capture_output=True, text=True,
                       timeout=30)
    check(r.returncode != 0 and want in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr))


@test
def test_bad_parked_directories_refused():
    d, _ = parked_vm()
    before = snapshot(d)
    start_fails(["dest", "--ram-dir", d], "already holds a parked VM")
    cut = copy_parked("cut-image")
    os.truncate(os.path.join(cut, "00-pc.ram.img"), (512 << 20) - 4096)
    start_fails(["source", "--ram-dir", cut], "is 536866816 bytes, the record says 536870912")
    gone = copy_parked("no-image")
    os.unlink(os.path.join(gone, "02-pc.bios.img"))
    start_fails(["source", "--ram-dir", gone], "No such file or directory")
    short = copy_parked("cut-devices")
    size = os.path.getsize(os.path.join(short, "device-state.bin"))
    os.truncate(os.path.join(short, "device-state.bin"), size - 100)
    start_fails(["source", "--ram-dir", short], "the stream was cut short")
    start_fails(["source", "--ram-dir", new_dir("empty")], "vm.json")
    check(snapshot(d) == before, "the parked VM's directory changed")


def resume_refused(directory, tag, want, extra=None, mem="512M", source_knows=True,
                   return_path=False):
    """The target QEMU refuses the parked VM with its own error; the qmigd
    source fails (unless the target only refuses the device state, which
    comes last: without a return path no source learns of that, QEMU's
    neither; with one it hears SHUT(1)), keeps serving, and `directory` is
    untouched."""
    before = snapshot(directory)
    src = guest = None
    try:
        src = resume_peer(tag + "-src", directory)
        guest = lg.LinuxGuest("dest", initrd(), tag, log_dir=WORK, extra=extra, mem=mem)
        src.set_migration(False)
        guest.set_migration(False)
        if return_path:
            for p in (src, guest):
                p.qmp.cmd("migrate-set-capabilities",
                          capabilities=[{"capability": "return-path", "state": True}])
        guest.qmp.cmd("migrate-incoming", uri="tcp:127.0.0.1:0", **{"exit-on-error": False})
        port = guest.status()["socket-address"][0]["port"]
        src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        si = wait_status(src, ("failed",) if source_knows else ("completed",), 120,
                         fail_on=("cancelled", "completed" if source_knows else "failed"))
        gi = wait_status(guest, ("failed",), 120, fail_on=("completed", "cancelled"))
        said = guest.log_text()  # QEMU reports the reason on stderr, error-desc is generic
        check(want in said, (gi, said))
        if source_knows:
            check(si.get("error-desc"), si)
            check(src.qmp.cmd("query-status")["status"] == "running", "source not ready again")
        print(f"  refused: QEMU says {want!r}, qmigd says {si.get('error-desc', 'completed')!r}")
    finally:
        stop_all(src, guest)
    check(snapshot(directory) == before, "the parked VM's directory changed")


@test
def test_resume_into_another_machine_refused():
    other = copy_parked("other-machine")
    rec = os.path.join(other, "vm.json")
    with open(rec) as f:
        text = f.read()
    with open(rec, "w") as f:
        f.write(text.replace("pc-q35-10.0", "pc-i440fx-10.0"))
    resume_refused(other, "other-machine",
                   "Machine type received is 'pc-i440fx-10.0' and local is 'pc-q35-10.0'")


@test
def test_resume_into_other_ram_size_refused():
    d, _ = parked_vm()
    resume_refused(d, "other-size", "Size mismatch: pc.ram: 0x20000000 != 0x40000000",
                   mem="1G")


@test
def test_device_state_the_target_cannot_take_refused():
    other = copy_parked("other-devices")
    path = os.path.join(other, "device-state.bin")
    with open(path, "rb") as f:
        ds = bytearray(f.read())
    at = ds.find(b"\x06serial\x00\x00\x00\x00")  # idstr, instance 0, then the version
    check(at > 0, "no serial section in the device state")
    ds[at + 11:at + 15] = (99).to_bytes(4, "big")
    with open(path, "wb") as f:
        f.write(ds)
    resume_refused(other, "other-devices", "savevm: unsupported version 99 for 'serial'",
                   source_knows=False)
    # With a return path the target's verdict reaches the source.
    resume_refused(other, "other-devices-rp", "savevm: unsupported version 99 for 'serial'",
                   return_path=True)


@test
def test_cut_stream_parks_nothing():
    d, _ = parked_vm()
    saved = os.path.join(WORK, unique_name("vm") + ".mig")
    src = park = None
    try:
        src = resume_peer("save-src", d)
        src.set_migration(False)
        src.qmp.cmd("migrate", uri=f"file:{saved}")
        wait_status(src, ("completed",), 120)
        whole = os.path.getsize(saved)
        cut = saved + ".cut"
        with open(saved, "rb") as a, open(cut, "wb") as b:
            b.write(a.read(whole - 300))
        target = new_dir("from-cut")
        park = park_peer("park-cut", target)
        park.set_migration(False)
        park.qmp.cmd("migrate-incoming", uri=f"file:{cut}")
        info = wait_status(park, ("failed",), 120, fail_on=("completed", "cancelled"))
        check("the stream was cut short" in info.get("error-desc", ""), info)
        check(os.listdir(target) == [], os.listdir(target))
        park.qmp.cmd("migrate-incoming", uri=f"file:{saved}")  # the same daemon, whole file
        info = wait_status(park, ("completed",), 120)
        check(info["parked"]["device-state-bytes"] > 1000, info)
    finally:
        stop_all(src, park)
    resume_into_qemu(target, "from-file")


if __name__ == "__main__":
    main()
