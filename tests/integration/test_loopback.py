#!/usr/bin/env python3
"""qmigd -> qmigd over loopback only (no QEMU): the set the sanitizer
builds run (ASan+UBSan, TSan), covering the thread hand-offs."""
import json
import os
import re
import subprocess

from itest import test, main, check, skip
from fixtures import run_cell, MiB
from fixtures import images, peers, begin, good_run
from runner import wait_status, QMIGD
from waiting import wait_until

SIZE = 32 * MiB

for multifd, ch, zpd in [(False, 0, "legacy"), (False, 0, "none"), (True, 1, "multifd"),
                         (True, 4, "multifd"), (True, 2, "legacy"), (True, 8, "none")]:
    def fn(multifd=multifd, ch=ch, zpd=zpd):
        run_cell("qmigd", "qmigd", SIZE, "mixed", multifd, ch or 2, zpd, blocks=("mem", "mem2"))
    fn.__name__ = f"test_{'multifd' + str(ch) if multifd else 'plain'}_{zpd}"
    test(fn)


@test
def test_cancel_then_migrate():
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        begin(src, dst, bandwidth=8 * MiB)
        src.qmp.cmd("migrate_cancel")
        wait_status(src, ("cancelled",), fail_on=("failed", "completed"))
        wait_status(dst, ("failed",), fail_on=("completed",))
        good_run(src, imgs, dst)


def send_buffers(dst):
    """SO_SNDBUF (ss's skmem tb) of every socket connected to dst's port."""
    port = dst.status()["socket-address"][0]["port"]
    out = subprocess.run(["ss", "-tmnH", "state", "established", "dport", f"= :{port}"],
                         capture_output=True, text=True, check=True).stdout
    return [int(x) for x in re.findall(r"\btb(\d+)", out)]


@test
def test_local_destination_gets_small_send_buffers():
    """A destination on this host: every channel's send buffer is
    --local-send-buffer (the kernel shows it doubled), the log says so; with
    0 the kernel's autotuning stays and the log says nothing."""
    for arg, want in ((None, 2 * 131072), ("65536", 2 * 65536), ("0", None)):
        extra = ["--local-send-buffer", arg] if arg else None
        with images(SIZE, "random") as imgs, peers("qmigd", "qmigd", imgs, extra) as (src, dst):
            begin(src, dst, bandwidth=4 * MiB)
            tbs = send_buffers(dst)
            src.qmp.cmd("migrate_cancel")
            wait_status(src, ("cancelled",), fail_on=("failed", "completed"))
            with open(src.log_path) as f:
                said = "destination is on this host" in f.read()
            check(len(tbs) == 3, f"main + 2 multifd sockets expected, ss shows {tbs}")
            if want:
                check(tbs == [want] * 3 and said, f"--local-send-buffer {arg}: {tbs}, {said}")
            else:
                check(2 * 131072 not in tbs and not said, f"autotuning expected: {tbs}, {said}")


def mid_pass(proc, d):
    """True while proc maps a scratch file of d: its fault pass runs. The
    file has no name by then (unlinked at once), so the maps say it."""
    check(proc.poll() is None, f"limits ended ({proc.returncode}) before its fault pass was seen")
    try:
        with open(f"/proc/{proc.pid}/maps") as f:
            return any(f" {d}/.qmigd-" in line for line in f)
    except OSError:
        return False


@test
def test_limits_reports_this_machine():
    """`qmigd limits` measures every figure bench.py's bounds use, leaves
    no scratch file behind, and refuses a directory that is not there."""
    p = subprocess.Popen([QMIGD, "limits", "--dir", "/dev/shm", "--idle", "1"],
                         stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=300)
    check(p.returncode == 0, f"qmigd limits: {p.returncode}")
    lim = json.loads(out)
    for key in ("zero_scan_gbps", "memcpy_gbps", "fault_ns_per_page", "fault_fresh_ns_per_page",
                "fault_idle_ns_per_page", "pwrite_gbps", "tcp_loopback_gbps", "tcp_cpu_s_per_gib", "tcp_cached_gbps",
                "tcp_cached_cpu_s_per_gib"):
        check(lim.get(key, -1) > 0, f"{key}: {lim.get(key)}")
    check(lim["fault_ns_per_page"] <= lim["fault_fresh_ns_per_page"], lim)
    check("tmpfs" in lim["backing"], lim["backing"])
    # Its own (ScratchFile names them .qmigd-TAG-PID-...): the daemons of
    # tests running beside this one calibrate in /dev/shm too.
    check(not [n for n in os.listdir("/dev/shm")
               if n.startswith(".qmigd-") and f"-{p.pid}-" in n],
          "scratch files left in /dev/shm")
    bad = subprocess.run([QMIGD, "limits", "--dir", "/nonexistent/qmigd"], capture_output=True,
                         text=True, timeout=30)
    check(bad.returncode != 0 and "/nonexistent/qmigd" in bad.stderr, bad.stderr)
    # The fault pass alone, as bench.py runs it beside each cell.
    f = json.loads(subprocess.run([QMIGD, "limits", "--dir", "/dev/shm", "--fault-bytes",
                                   str(32 << 20)], capture_output=True, text=True, timeout=120,
                                  check=True).stdout)
    check(f["fault_bytes"] == 32 << 20 and f["threads"] >= 1, f)
    check(f["fault_seconds"] > 0 and f["fault_cpu_seconds"] > 0
          and abs(f["fault_cpu_ns_per_page"] - f["fault_cpu_seconds"] * 1e9 / (8 << 10)) < 1, f)
    zero = subprocess.run([QMIGD, "limits", "--fault-bytes", "0"], capture_output=True,
                          text=True, timeout=30)
    check(zero.returncode != 0 and "--fault-bytes" in zero.stderr, zero.stderr)
    # Faulted and reported in whole 512 KiB chunks.
    f = json.loads(subprocess.run([QMIGD, "limits", "--fault-bytes", "4096"], capture_output=True,
                                  text=True, timeout=60, check=True).stdout)
    check(f["fault_bytes"] == 512 << 10, f)
    # Killed mid-pass, it leaves no scratch file (a tmpfs would keep its memory).
    import tempfile
    d = tempfile.mkdtemp(prefix="qmigd-limits-", dir="/dev/shm")
    try:
        k = subprocess.Popen([QMIGD, "limits", "--dir", d, "--fault-bytes", str(1 << 30)])
        wait_until("limits to map its scratch file (the fault pass runs)",
                   lambda: mid_pass(k, d), seen=lambda: os.listdir(d))
        k.terminate()
        k.wait(timeout=30)
        check(os.listdir(d) == [], f"left behind by a killed limits: {os.listdir(d)}")
    finally:
        subprocess.run(["rm", "-rf", d])


@test
def test_limits_on_a_small_tmpfs_and_planted_links():
    """On a 16 MiB tmpfs the 64 MiB fault pass cannot be backed: -1, not
    SIGBUS. Links planted at the scratch names qmigd used to take (its pid
    was the only unknown) are neither followed nor touched."""
    import tempfile
    mnt = tempfile.mkdtemp(prefix="qmigd-small-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", mnt]).returncode:
        os.rmdir(mnt)
        skip("cannot mount a tmpfs (not root?)", machine=True)
    victim = os.path.join(mnt, "victim")
    try:
        with open(victim, "wb") as f:
            f.write(b"precious")
        with open("/proc/sys/kernel/ns_last_pid") as f:
            last = int(f.read())
        for pid in range(last + 1, last + 200):
            os.symlink(victim, os.path.join(mnt, f".qmigd-limits-{pid}"))
        r = subprocess.run([QMIGD, "limits", "--dir", mnt], capture_output=True, text=True,
                           timeout=300)
        check(r.returncode == 0, f"qmigd limits on a small tmpfs: {r.returncode} {r.stderr[-500:]}")
        lim = json.loads(r.stdout)
        check(lim["fault_ns_per_page"] == -1 and lim["fault_fresh_ns_per_page"] == -1, lim)
        check(lim["tcp_loopback_gbps"] == -1, lim)  # 256 MiB of it cannot be had either
        check(lim["zero_scan_gbps"] > 0, lim)
        # 64 MiB of a 16 MiB tmpfs cannot be faulted either: -1, not SIGBUS.
        r = subprocess.run([QMIGD, "limits", "--dir", mnt, "--fault-bytes", str(64 << 20)],
                           capture_output=True, text=True, timeout=120)
        check(r.returncode == 0, f"--fault-bytes on a small tmpfs: {r.returncode} {r.stderr}")
        f = json.loads(r.stdout)
        check(f["fault_seconds"] == -1 and f["fault_cpu_ns_per_page"] == -1, f)
        with open(victim, "rb") as f:
            check(f.read() == b"precious", "a planted link was followed")
        left = [n for n in os.listdir(mnt) if n.startswith(".qmigd-") and
                not os.path.islink(os.path.join(mnt, n))]
        check(not left, f"scratch files left: {left}")
    finally:
        subprocess.run(["umount", mnt])
        os.rmdir(mnt)


if __name__ == "__main__":
    main()
