#!/usr/bin/env python3
"""The capabilities a management stack sets besides multifd and postcopy:
pause-before-switchover (pre-switchover, migrate-continue), switchover-ack,
validate-uuid and x-ignore-shared, each with QEMU 10 at the other end in
both directions and between two qmigd, byte-identical; QEMU's refusals of
combinations and of migrate-continue compared with a live QEMU 10's words;
the capabilities qmigd refuses say why."""
import hashlib
import time

from itest import test, main, check, skip
from fixtures import images, peers, MiB
from runner import Peer, wait_status, files_equal, unique_name, remove, make_image, stop_all
from qmp import QMPError
from waiting import wait_until

SIZE = 32 * MiB
DIRECTIONS = (("qemu", "qmigd"), ("qmigd", "qemu"), ("qmigd", "qmigd"))


def caps(peer, **states):
    peer.qmp.cmd("migrate-set-capabilities",
                 capabilities=[{"capability": k.replace("_", "-"), "state": v}
                               for k, v in states.items()])


def error_of(fn):
    try:
        fn()
    except QMPError as e:
        return e.desc
    return ""


def start(src, dst, bandwidth=0, exit_on_error=True):
    for p in (src, dst):
        p.qmp.cmd("migrate-set-parameters", {"max-bandwidth": bandwidth})
    dst.qmp.cmd("migrate-incoming", {"uri": "tcp:127.0.0.1:0", "exit-on-error": exit_on_error})
    port = dst.status()["socket-address"][0]["port"]
    src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")


def finish(src, dst, imgs):
    si = wait_status(src, ("completed",), 60)
    di = wait_status(dst, ("completed",), 60)
    check(files_equal(imgs[0][1], imgs[0][2]), "images differ")
    return si, di


def each_direction(name):
    """Registers test_NAME_SRC_to_DST for each direction: fn(src_kind, dst_kind)."""
    def register(body):
        for src_kind, dst_kind in DIRECTIONS:
            def fn(src_kind=src_kind, dst_kind=dst_kind):
                body(src_kind, dst_kind)
            fn.__name__ = f"test_{name}_{src_kind}_to_{dst_kind}"
            fn.__doc__ = body.__doc__
            test(fn)
        return body
    return register


def migration_events(peer):
    return [e for e in peer.qmp.poll_events() if e.get("event") == "MIGRATION"]


def statuses(peer):
    return [e["data"]["status"] for e in migration_events(peer)]


def stamp(event):
    return event["timestamp"]["seconds"] + event["timestamp"]["microseconds"] / 1e6


# Capability sets and what both refuse or take: QEMU's words must be ours.
COMBINATIONS = (
    {"zero-copy-send": True},
    {"multifd": True, "zero-copy-send": True},
    {"multifd": True, "xbzrle": True},
    {"mapped-ram": True, "xbzrle": True},
    {"switchover-ack": True},
    {"return-path": True, "switchover-ack": True},
    {"postcopy-ram": True, "x-ignore-shared": True},
    {"postcopy-ram": True, "multifd": True},
    {"postcopy-preempt": True},
    {"pause-before-switchover": True, "validate-uuid": True, "x-ignore-shared": True,
     "late-block-activate": True, "zero-blocks": True, "dirty-bitmaps": True,
     "postcopy-blocktime": True},
)
# Taken by QEMU 10 here, refused by qmigd with its reason.
REFUSED = ("x-colo", "rdma-pin-all", "background-snapshot", "release-ram")


@test
def test_refusals_in_qemus_words():
    """Each combination is refused (or taken) by qmigd as by QEMU 10, in
    both roles; migrate-continue outside pre-switchover too, by QMP and HMP."""
    for role in ("source", "dest"):
        with images(SIZE, "zero") as imgs:
            ram = [(n, s, z) for n, s, _, z in imgs]
            q = Peer("qemu", role, ram, "caps-q")
            m = Peer("qmigd", role, ram, "caps-m")
            try:
                for combo in COMBINATIONS:
                    words = []
                    for p in (q, m):
                        words.append(error_of(lambda: p.qmp.cmd(
                            "migrate-set-capabilities",
                            capabilities=[{"capability": k, "state": v} for k, v in combo.items()])))
                        p.qmp.cmd("migrate-set-capabilities", capabilities=[
                            {"capability": k, "state": False} for k in combo])
                    check(words[0] == words[1], f"{role} {combo}: QEMU {words[0]!r}, qmigd {words[1]!r}")
                for name in REFUSED:
                    e = error_of(lambda: caps(m, **{name: True}))
                    check(e.startswith(f"Capability '{name}' is not supported by qmigd: "), e)
                for state in ("pre-switchover", "active", "bogus"):
                    qmp = [error_of(lambda: p.qmp.cmd("migrate-continue", state=state)) for p in (q, m)]
                    check(qmp[0] == qmp[1], f"migrate-continue {state}: {qmp}")
                    hmp = [p.qmp.hmp(f"migrate_continue {state}") for p in (q, m)]
                    check(hmp[0] == hmp[1], f"migrate_continue {state}: {hmp}")
                check(q.qmp.hmp("migrate_continue bogus") == "Error: invalid parameter value: bogus\r\n")
            finally:
                stop_all(q, m)


NEEDS = {"switchover-ack": "return-path", "zero-copy-send": "multifd",
         "postcopy-preempt": "postcopy-ram"}


@test
def test_docs_table_matches_the_daemon():
    """docs/monitor.md's capability table lists query-migrate-capabilities'
    names in its order; the ones it says are refused are, the rest are taken."""
    import os
    import re
    page = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "monitor.md")
    text = open(page).read().split("## Capabilities", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z-]+)` \| (.*) \|$", text, re.M)
    with images(SIZE, "zero") as imgs:
        m = Peer("qmigd", "source", [(n, s, z) for n, s, _, z in imgs], "caps-readme")
        try:
            listed = [c["capability"] for c in m.qmp.cmd("query-migrate-capabilities")]
            check([name for name, _ in rows] == listed, f"docs {rows} vs {listed}")
            for name, what in rows:
                want = [name] + ([NEEDS[name]] if name in NEEDS else [])
                e = error_of(lambda: m.qmp.cmd("migrate-set-capabilities", capabilities=[
                    {"capability": c, "state": True} for c in want]))
                check(what.startswith("refused") == bool(e), f"{name}: docs {what!r}, daemon {e!r}")
                m.qmp.cmd("migrate-set-capabilities", capabilities=[
                    {"capability": c, "state": False} for c in reversed(want)])
        finally:
            m.stop()


@each_direction("pause_before_switchover")
def pause_cell(src_kind, dst_kind):
    with images(SIZE, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
        caps(s, events=True, pause_before_switchover=True)
        start(s, d)
        wait_status(s, ("pre-switchover",), 30)
        check(s.qmp.cmd("query-status")["status"] == "finish-migrate", "the VM runs")
        e = error_of(lambda: s.qmp.cmd("migrate-continue", state="active"))
        check(e == "Migration not in expected state: pre-switchover", e)
        check(s.status()["status"] == "pre-switchover", s.status())
        check(d.status()["status"] == "active", d.status())
        told = time.time()
        s.qmp.cmd("migrate-continue", state="pre-switchover")
        finish(s, d, imgs)
        events = migration_events(s)
        seq = [e["data"]["status"] for e in events]
        check(seq[-3:] == ["pre-switchover", "device", "completed"], seq)
        # It stayed there until told: it said `device` after the continue
        # (both clocks are this host's).
        check(stamp(events[-2]) >= told, f"device at {stamp(events[-2]):.6f}, told at {told:.6f}")


@test
def test_cancel_in_pre_switchover():
    """A cancel while paused before switchover: cancelled, the VM runs
    again, and the next migration goes through."""
    for src_kind in ("qemu", "qmigd"):
        with images(SIZE, "mixed") as imgs, peers(src_kind, "qmigd", imgs) as (s, d):
            caps(s, pause_before_switchover=True)
            start(s, d)
            wait_status(s, ("pre-switchover",), 30)
            s.qmp.cmd("migrate_cancel")
            wait_status(s, ("cancelled",), 30, fail_on=("failed",))
            check(s.qmp.cmd("query-status")["status"] == "running", "the VM stays stopped")
            d.stop()
            d2 = Peer("qmigd", "dest", [("mem", imgs[0][2], SIZE)], "dst2")
            try:
                start(s, d2)
                wait_status(s, ("pre-switchover",), 30)
                s.qmp.hmp("migrate_continue pre-switchover")
                finish(s, d2, imgs)
            finally:
                d2.stop()


@each_direction("switchover_ack")
def ack_cell(src_kind, dst_kind):
    with images(SIZE, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
        for p in (s, d):
            caps(p, return_path=True, switchover_ack=True)
        start(s, d)
        finish(s, d, imgs)
        if src_kind == "qmigd":
            check("acknowledges the switchover" in s.log_text(), "no ack heard")
        if dst_kind == "qmigd":
            check("switchover acknowledged" in d.log_text(), "no ack sent")


@test
def test_no_switchover_without_the_ack():
    """A destination that never acks (switchover-ack off there) holds a
    qmigd source with it on: all RAM sent, still active; once the VM is
    stopped it needs no ack and completes, as QEMU's source."""
    for dst_kind in ("qemu", "qmigd"):
        with images(SIZE, "mixed") as imgs, peers("qmigd", dst_kind, imgs) as (s, d):
            caps(s, return_path=True, switchover_ack=True)
            caps(d, return_path=True)
            start(s, d)

            def all_sent():
                info = s.status()
                check(info.get("status") in ("setup", "active"), f"without the ack: {info}")
                return info.get("ram", {}).get("remaining", 1) == 0 and info
            t0 = wait_until("the source to have sent all RAM", all_sent)["total-time"]

            # Held: a switchover can only be seen not to happen over time,
            # here a second by the daemon's own clock (total-time; 20 of
            # its 50 ms waits for the ack), active all along.
            def held_a_second():
                info = s.status()
                check(info["status"] == "active" and info["ram"]["remaining"] == 0, info)
                return info["total-time"] >= t0 + 1000
            wait_until("the source's total-time to move on by 1 s", held_a_second)
            s.qmp.cmd("stop")
            finish(s, d, imgs)


@each_direction("validate_uuid")
def uuid_cell(src_kind, dst_kind):
    a, b = "6a3c0b0e-1d2f-4b5c-9e8f-0123456789ab", "6a3c0b0e-1d2f-4b5c-9e8f-ffffffffffff"

    def uuid_arg(kind, u):
        return ["-uuid", u] if kind == "qemu" else ["--uuid", u]
    # Same UUID: completes. Another one: the destination refuses it.
    for dst_uuid, ok in ((a, True), (b, False)):
        with images(SIZE, "mixed") as imgs, \
                peers(src_kind, dst_kind, imgs, uuid_arg(src_kind, a),
                      uuid_arg(dst_kind, dst_uuid)) as (s, d):
            caps(s, validate_uuid=True)
            start(s, d, exit_on_error=False)
            if ok:
                finish(s, d, imgs)
                continue
            wait_status(s, ("failed", "completed"), 30, fail_on=())
            info = wait_status(d, ("failed",), 30, fail_on=())
            if dst_kind == "qmigd":
                check(f"UUID received is {a} and local is {b}" in info.get("error-desc", ""),
                      info)
            else:
                check(f"UUID received is {a} and local is {b}" in d.log_text(), d.log_text())


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@each_direction("x_ignore_shared")
def ignore_shared_cell(src_kind, dst_kind):
    """Both ends map the same file: no page crosses, the image is
    unchanged, and a few KiB make the whole stream."""
    path = f"/dev/shm/{unique_name('shared')}.ram"
    make_image(path, SIZE, "mixed")
    before = digest(path)
    ram = [("mem", path, SIZE)]
    s = Peer(src_kind, "source", ram, "ish-src")
    d = Peer(dst_kind, "dest", ram, "ish-dst")
    try:
        for p in (s, d):
            caps(p, x_ignore_shared=True)
        start(s, d)
        si = wait_status(s, ("completed",), 30)
        wait_status(d, ("completed",), 30)
        check(si["ram"]["transferred"] < 64 * 1024, si["ram"])
        check(si["ram"]["normal"] == 0, si["ram"])
        check(si["ram"]["total"] == 0, si["ram"])  # ram_bytes_total(): ignored blocks left out
        check(digest(path) == before, "the shared image changed")
    finally:
        try:
            stop_all(s, d)
        finally:
            remove(path)


@test
def test_x_ignore_shared_checks():
    """A qmigd destination checks the block's address (QEMU's words) and
    that the source has the capability too."""
    path = f"/dev/shm/{unique_name('shared')}.ram"
    make_image(path, SIZE, "zero")
    try:
        for src_caps, addr, want in (({"x_ignore_shared": True}, "4096",
                                      "Mismatched GPAs for block mem 0!= 4096"),
                                     ({}, "0", "Capability x-ignore-shared is on, but received "
                                               "capability is off")):
            s = Peer("qemu", "source", [("mem", path, SIZE)], "ish-src")
            d = Peer("qmigd", "dest", [], "ish-dst",
                     ["--ram", f"mem={path},size={SIZE},addr={addr}"])
            try:
                caps(s, **src_caps)
                caps(d, x_ignore_shared=True)
                start(s, d)
                info = wait_status(d, ("failed",), 30, fail_on=())
                check(want in info.get("error-desc", ""), info)
            finally:
                stop_all(s, d)
    finally:
        remove(path)


@each_direction("zero_copy_send")
def zero_copy_cell(src_kind, dst_kind):
    """multifd with zero-copy-send: byte-identical; over loopback the
    kernel copies every send after all, which the source counts. A qmigd
    source reads pages through the file (--page-path file): zero copy
    sends from the guest's memory all the same."""
    src_extra = ["--page-path", "file"] if src_kind == "qmigd" else None
    with images(SIZE, "mixed") as imgs, peers(src_kind, dst_kind, imgs, src_extra) as (s, d):
        for p in (s, d):
            caps(p, multifd=True)
        caps(s, zero_copy_send=True)
        start(s, d)
        si, _ = finish(s, d, imgs)
        missed = si["ram"]["dirty-sync-missed-zero-copy"]
        check(0 < missed <= 2 * si["ram"]["dirty-sync-count"] + 2, si["ram"])
        if src_kind == "qmigd":
            check("Zero-copy-send fallbacks happened: " in s.qmp.hmp("info migrate"), "hmp")


@test
def test_zero_copy_send_refused_on_unix_sockets():
    """A unix socket cannot send with MSG_ZEROCOPY: the migration fails
    in QEMU's words, and the source can migrate again."""
    words = []
    for src_kind in ("qemu", "qmigd"):
        with images(SIZE, "mixed") as imgs, peers(src_kind, "qmigd", imgs) as (s, d):
            for p in (s, d):
                caps(p, multifd=True)
            caps(s, zero_copy_send=True)
            path = f"/tmp/{unique_name('zc')}.sock"
            d.qmp.cmd("migrate-incoming", uri=f"unix:{path}")
            s.qmp.cmd("migrate", uri=f"unix:{path}")
            info = wait_status(s, ("failed",), 30, fail_on=("completed",))
            words.append(info.get("error-desc"))
            remove(path)
    check(words[0] == words[1] == "Zero copy send feature not detected in host kernel", words)


def bitmap_of(peer):
    """(dirty bytes count, sha256) of bm0 on node disk0."""
    nodes = peer.qmp.cmd("query-named-block-nodes")
    bm = [b for n in nodes if n.get("node-name") == "disk0" for b in n.get("dirty-bitmaps", [])
          if b["name"] == "bm0"]
    check(len(bm) == 1, f"no bitmap bm0 on disk0: {nodes}")
    sha = peer.qmp.cmd("x-debug-block-dirty-bitmap-sha256", {"node": "disk0", "name": "bm0"})
    return bm[0]["count"], bm[0]["persistent"], sha["sha256"]


@test
def test_dirty_bitmaps_survive_parking():
    """A QEMU 10 VM with a persistent dirty bitmap on a qcow2 disk is parked
    (dirty-bitmaps on: the bitmap's iterable section kept in order) and
    resumed into a new QEMU on the same disk: the bitmap is there, the same
    bits, and the RAM is byte-identical."""
    import os
    import shutil
    import subprocess
    import tempfile
    if not shutil.which("qemu-img"):
        skip("qemu-img is needed (scripts/install-deps.sh installs qemu-utils)")
    work = tempfile.mkdtemp(prefix="qmigd-bitmaps-", dir="/dev/shm")
    disk = os.path.join(work, "disk.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", disk, "64M"], check=True)
    blockdev = ["-blockdev", f"driver=qcow2,node-name=disk0,file.driver=file,file.filename={disk}"]
    park_dir = os.path.join(work, "vm")
    os.mkdir(park_dir)
    a_ram, b_ram = os.path.join(work, "a.ram"), os.path.join(work, "b.ram")
    make_image(a_ram, SIZE, "mixed")
    a = park = src = b = None
    try:
        a = Peer("qemu", "source", [("mem", a_ram, SIZE)], "bm-a", blockdev)
        a.qmp.cmd("block-dirty-bitmap-add", {"node": "disk0", "name": "bm0", "persistent": True})
        for at in ("0", "1M", "40M"):
            a.qmp.hmp(f'qemu-io disk0 "write {at} 64k"')
        before = bitmap_of(a)
        check(before[0] > 0 and before[1], before)
        park = Peer("qmigd", "dest", [], "bm-park", ["--ram-dir", park_dir])
        caps(a, dirty_bitmaps=True)
        start(a, park)
        wait_status(a, ("completed",), 30)
        wait_status(park, ("completed",), 30)
        check(os.path.getsize(os.path.join(park_dir, "iterable-state.bin")) > 0, "nothing kept")
        a.stop()
        a = None
        src = Peer("qmigd", "source", [], "bm-src", ["--ram-dir", park_dir])
        b = Peer("qemu", "dest", [("mem", b_ram, SIZE)], "bm-b", blockdev)
        caps(src, dirty_bitmaps=True)
        caps(b, dirty_bitmaps=True)
        start(src, b)
        wait_status(src, ("completed",), 30)
        wait_status(b, ("completed",), 30)
        after = bitmap_of(b)
        check(after == before, f"bitmap before {before}, after {after}")
        check(files_equal(a_ram, b_ram), "RAM differs")
    finally:
        for p in (a, park, src, b):
            if p:
                p.stop()
        shutil.rmtree(work, True)


if __name__ == "__main__":
    main()
