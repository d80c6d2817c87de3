#!/usr/bin/env python3
"""Postcopy (capability postcopy-ram, with and without postcopy-preempt)
and its recovery with QEMU 10 `-M none` guests and qmigd daemons: precopy runs under a max-bandwidth the guest outruns, then
migrate-start-postcopy switches over -- the source discards what is dirty
again, sends the device state packaged between LISTEN and RUN, and streams
the rest. Byte-identical QEMU 10 -> qmigd, qmigd -> QEMU 10, qmigd -> qmigd,
each side's MIGRATION events as QEMU's; a VM parked by postcopy and resumed
by postcopy, its directory untouched; QEMU's refusals in QEMU's words next
to a live QEMU 10; and a qmigd source serving a destination's page requests
before anything else, each page once, and failing with QEMU's words on bad
ones. Recovery: migrate-pause on either side, migrate-recover on the
destination and `migrate resume=true` on the source, with QEMU 10 at either
end and qmigd <-> qmigd, byte-identical, each side's events as QEMU's."""
import os
import re
import struct
import subprocess
import sys
import tempfile

from itest import test, main, check
from fixtures import images, peers, MiB
from postcopy_fake import rp, req_pages, req_pages_id, fake_run
from runner import (Peer, Guest, start_incoming, wait_status, files_equal, make_image,
                    remove, unique_name, free_port, stop_all)
from waiting import wait_until

SIZE = 64 * MiB
PC = [{"capability": "postcopy-ram", "state": True}, {"capability": "events", "state": True}]
SRC_EVENTS = ["setup", "active", "device", "postcopy-active", "completed"]
DST_EVENTS = ["setup", "active", "postcopy-active", "completed"]


PREEMPT = [{"capability": "postcopy-preempt", "state": True}]


def with_postcopy(*peers_, preempt=False):
    for p in peers_:
        p.qmp.cmd("migrate-set-capabilities", capabilities=PC + (PREEMPT if preempt else []))


def events(peer, last="completed"):
    """The peer's MIGRATION statuses in order, once the one that ends them
    (`last`) came: QEMU sets a status before its migration thread emits
    the event, so query-migrate may say it first."""
    def statuses():
        return [e["data"]["status"] for e in peer.qmp.poll_events() if e["event"] == "MIGRATION"]
    wait_until(f"{peer.kind} {peer.role}'s MIGRATION {last} event", lambda: last in statuses(),
               seen=statuses)
    return statuses()


def sent_at_least(s, field, nbytes, status):
    """Until the source's ram `field` (transferred, postcopy-bytes) is at
    least `nbytes`, its status `status` all along."""
    last = {}

    def sent():
        info = last["info"] = s.status()
        check(info["status"] == status, f"{s.kind} source left {status}: {info}")
        return info.get("ram", {}).get(field, 0) >= nbytes
    wait_until(f"{s.kind} source to send {nbytes >> 20} MiB ({field}) while {status}", sent,
               seen=lambda: last["info"].get("ram"))


def postcopy_run(s, d, bandwidth=8 * MiB, precopy_bytes=8 * MiB, hmp=False, params=None,
                 preempt=False):
    """Precopy under `bandwidth` until it has sent `precopy_bytes` (far
    from all of RAM: it is still precopy then), then migrate-start-postcopy;
    returns both sides' final query-migrate."""
    with_postcopy(s, d, preempt=preempt)
    s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": bandwidth, **(params or {})})
    port = start_incoming(d)
    s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
    wait_status(s, ("active",))
    sent_at_least(s, "transferred", precopy_bytes, "active")
    if hmp:
        out = s.qmp.cmd("human-monitor-command", **{"command-line": "migrate_start_postcopy"})
        check(out == "", out)
    else:
        s.qmp.cmd("migrate-start-postcopy")
    si = wait_status(s, ("completed",), timeout=60)
    di = wait_status(d, ("completed",), timeout=60)
    return si, di


def cell(src_kind, dst_kind, preempt):
    def fn():
        with images(SIZE * 2, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
            _, s_img, d_img, _ = imgs[0]
            guest = Guest(s_img, rate=20000, pattern="hot", hot_set=32 * MiB) \
                if src_kind == "qmigd" else None
            try:
                si, di = postcopy_run(s, d, hmp=(dst_kind == "qmigd"), preempt=preempt)
            finally:
                if guest:
                    guest.stop()
            check(files_equal(s_img, d_img), "images differ")
            ram = si["ram"]
            check(ram["postcopy-bytes"] > 0 and ram["precopy-bytes"] > 0, ram)
            check("downtime" in si and "expected-downtime" not in si, si)
            check(d.qmp.cmd("query-status")["status"] == "running", "destination not running")
            check(s.qmp.cmd("query-status")["status"] == "postmigrate", "source not postmigrate")
            se, de = events(s), events(d)
            check(se == SRC_EVENTS, f"{src_kind} source events {se}")
            check(de == DST_EVENTS, f"{dst_kind} destination events {de}")
            for p in (s, d):
                if p.kind == "qmigd":
                    check(("preempt channel connected" in p.log_text()) == preempt,
                          f"{p.role}: preempt channel {'missing' if preempt else 'made'}")
            print(f"  {src_kind} -> {dst_kind}: precopy {ram['precopy-bytes'] >> 20} MiB, "
                  f"postcopy {ram['postcopy-bytes'] >> 20} MiB, downtime {si['downtime']} ms, "
                  f"total {si['total-time']} ms")
    fn.__name__ = f"test_postcopy{'_preempt' if preempt else ''}_{src_kind}_to_{dst_kind}"
    test(fn)


for preempt in (False, True):
    for src_kind, dst_kind in (("qmigd", "qemu"), ("qemu", "qmigd"), ("qmigd", "qmigd")):
        cell(src_kind, dst_kind, preempt)


PAUSED_SRC = ["setup", "active", "device", "postcopy-active", "postcopy-paused",
              "postcopy-recover-setup", "postcopy-recover", "postcopy-active", "completed"]
PAUSED_DST = ["setup", "active", "postcopy-active", "postcopy-paused", "postcopy-recover",
              "postcopy-active", "completed"]


def recover(s, d, host="127.0.0.1"):
    """migrate-recover on the destination, resume on the source; waits for
    both to complete."""
    port = free_port()
    d.qmp.cmd("migrate-recover", uri=f"tcp:{host}:{port}")
    s.qmp.cmd("migrate", uri=f"tcp:{host}:{port}", resume=True)
    si = wait_status(s, ("completed",), timeout=60, fail_on=("failed", "cancelled"))
    wait_status(d, ("completed",), timeout=60, fail_on=("failed", "cancelled"))
    return si


def into_postcopy(s, d, bandwidth, postcopy_bandwidth, preempt=False):
    """A migration under `bandwidth`, switched to postcopy (limited to
    `postcopy_bandwidth`) as soon as it is active; returns once it is."""
    with_postcopy(s, d, preempt=preempt)
    s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": bandwidth,
                                         "max-postcopy-bandwidth": postcopy_bandwidth})
    port = start_incoming(d)
    s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
    wait_status(s, ("active",))
    s.qmp.cmd("migrate-start-postcopy")
    wait_status(s, ("postcopy-active",))


def recovery_cell(src_kind, dst_kind, pauser, preempt=False):
    def fn():
        with images(SIZE, "random") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
            into_postcopy(s, d, 8 * MiB, 16 * MiB, preempt)
            # Paused mid-stream: 4 of 64 MiB went (at 16 MiB/s the rest takes
            # seconds more, however slow this machine).
            sent_at_least(s, "postcopy-bytes", 4 * MiB, "postcopy-active")
            (s if pauser == "source" else d).qmp.cmd("migrate-pause")
            si = wait_status(s, ("postcopy-paused",), timeout=30, fail_on=("failed", "completed"))
            wait_status(d, ("postcopy-paused",), timeout=30, fail_on=("failed", "completed"))
            check(si.get("error-desc"), si)
            err = error_of(s, "migrate_cancel")
            check(err == "Postcopy migration in progress, cannot cancel.", err)
            si = recover(s, d)
            check(files_equal(imgs[0][1], imgs[0][2]), "images differ after the recovery")
            se, de = events(s), events(d)
            check(se == PAUSED_SRC, f"{src_kind} source events {se}")
            check(de == PAUSED_DST, f"{dst_kind} destination events {de}")
            print(f"  {src_kind} -> {dst_kind}, paused on the {pauser}: completed, "
                  f"{si['ram']['postcopy-bytes'] >> 20} MiB after the switch")
    fn.__name__ = (f"test_recovery_{src_kind}_to_{dst_kind}_paused_on_{pauser}"
                   f"{'_preempt' if preempt else ''}")
    test(fn)


for src_kind, dst_kind in (("qmigd", "qemu"), ("qemu", "qmigd"), ("qmigd", "qmigd")):
    for pauser in ("source", "dest"):
        recovery_cell(src_kind, dst_kind, pauser, preempt=(src_kind == dst_kind == "qmigd"
                                                          and pauser == "source"))


def snapshot(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        st = os.stat(os.path.join(directory, name))
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = (st.st_size, st.st_mtime_ns, hash(f.read()))
    return out


@test
def test_park_and_resume_by_postcopy():
    """QEMU 10 -> qmigd --ram-dir by postcopy (the device state comes in
    the package, before RAM ends), then qmigd --ram-dir -> a new QEMU 10
    by postcopy started at once: the RAM is the guest's, the directory
    unchanged."""
    work = tempfile.mkdtemp(prefix="qmigd-pc-", dir="/dev/shm")
    guest_img, out_img = os.path.join(work, "guest.ram"), os.path.join(work, "out.ram")
    directory = os.path.join(work, "vm")
    os.mkdir(directory)
    make_image(guest_img, SIZE, "mixed", seed=3)
    try:
        g = Peer("qemu", "source", [("mem", guest_img, SIZE)], "pc-guest")
        park = Peer("qmigd", "dest", [], "pc-park", extra=["--ram-dir", directory])
        try:
            si, di = postcopy_run(g, park, bandwidth=4 * MiB, precopy_bytes=2 * MiB)
            check(di["parked"]["machine-type"] == "none", di)
        finally:
            stop_all(park, g)
        before = snapshot(directory)
        src = Peer("qmigd", "source", [], "pc-resume", extra=["--ram-dir", directory])
        new = Peer("qemu", "dest", [("mem", out_img, SIZE)], "pc-new")
        try:
            with_postcopy(src, new)
            port = start_incoming(new)
            src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            src.qmp.cmd("migrate-start-postcopy")
            si = wait_status(src, ("completed",), timeout=60)
            wait_status(new, ("completed",), timeout=60)
            check(si["ram"]["postcopy-bytes"] > SIZE // 4, si)  # most of RAM after the switch
            check(new.qmp.cmd("query-status")["status"] == "running")
        finally:
            stop_all(src, new)
        check(files_equal(guest_img, out_img), "the resumed RAM is not the guest's")
        check(snapshot(directory) == before, "the parked VM's directory changed")
    finally:
        remove(guest_img, out_img)
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
        os.rmdir(work)


@test
def test_qmig_run_postcopy_in_one_command():
    """`qmig run --postcopy` turns postcopy on at both ends, switches at
    once and says when the destination runs the guest."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qemu", imgs) as (s, d):
        d.release_monitor()  # QEMU serves one monitor client: qmig's
        r = subprocess.run([sys.executable, os.path.join(root, "scripts", "qmig"), "run",
                            "--src", s.qmp_path, "--dst", d.qmp_path, "--postcopy",
                            "--verify", f"{imgs[0][1]}:{imgs[0][2]}"],
                           capture_output=True, text=True, timeout=120)
        d.reconnect_monitor()
        check(r.returncode == 0, r.stdout + r.stderr)
        # At once: most of RAM went after the switch (postcopy-bytes, below).
        check(re.search(r"switching to postcopy after [\d.]+ s", r.stdout), r.stdout)
        check("the destination runs the guest" in r.stdout, r.stdout)
        check("identical" in r.stdout, r.stdout)
        check(s.status()["ram"]["postcopy-bytes"] > SIZE // 2, s.status())


def error_of(peer, cmd, **args):
    r = peer.qmp.execute(cmd, **args)
    check("error" in r, f"{peer.kind}: {cmd} succeeded: {r}")
    return r["error"]["desc"]


def caps(**kv):
    return [{"capability": k.replace("_", "-"), "state": v} for k, v in kv.items()]


@test
def test_refusals_in_qemus_words():
    """migrate-start-postcopy without the capability and before a
    migration, postcopy-ram with multifd or mapped-ram, and migrate_cancel
    once postcopy runs: qmigd says what QEMU 10 says, in both roles."""
    with images(SIZE, "mixed") as imgs:
        for role in ("source", "dest"):
            q = Peer("qemu", role, [("mem", imgs[0][1], SIZE)], "ref-q")
            m = Peer("qmigd", role, [("mem", imgs[0][1], SIZE)], "ref-m")
            try:
                for peer in (q, m):
                    peer.errors = [error_of(peer, "migrate-start-postcopy")]
                    peer.errors.append(error_of(peer, "migrate-set-capabilities",
                                                capabilities=caps(multifd=True, postcopy_ram=True)))
                    peer.errors.append(error_of(peer, "migrate-set-capabilities",
                                                capabilities=caps(mapped_ram=True,
                                                                  postcopy_ram=True)))
                    peer.errors.append(error_of(peer, "migrate-set-capabilities",
                                                capabilities=caps(postcopy_preempt=True)))
                    peer.qmp.cmd("migrate-set-capabilities", capabilities=caps(postcopy_ram=True))
                    if role == "source":
                        peer.errors.append(error_of(peer, "migrate-start-postcopy"))
                    peer.errors.append(error_of(peer, "migrate-set-capabilities",
                                                capabilities=caps(multifd=True)))
                    peer.errors.append(error_of(peer, "migrate-pause"))
                    peer.errors.append(error_of(peer, "migrate-recover", uri="tcp:127.0.0.1:1"))
                    peer.errors.append(error_of(peer, "migrate", uri="tcp:127.0.0.1:1",
                                                resume=True))
                check(q.errors == m.errors, f"{role}: QEMU {q.errors} qmigd {m.errors}")
                print(f"  {role}: {m.errors}")
            finally:
                stop_all(q, m)


@test
def test_cancel_refused_once_postcopy_runs():
    """A source in postcopy-active cannot take the VM back: migrate_cancel
    is refused (QEMU's words, next to a QEMU source), and the migration
    completes byte-identical."""
    for src_kind in ("qemu", "qmigd"):
        with images(SIZE, "mixed") as imgs, peers(src_kind, "qmigd", imgs) as (s, d):
            into_postcopy(s, d, 4 * MiB, 16 * MiB)
            err = error_of(s, "migrate_cancel")
            check(err == "Postcopy migration in progress, cannot cancel.", err)
            si = wait_status(s, ("completed",), timeout=60)
            wait_status(d, ("completed",), timeout=60)
            check(files_equal(imgs[0][1], imgs[0][2]), f"{src_kind}: images differ")
            # max-postcopy-bandwidth holds: postcopy-bytes at 16 MiB/s.
            floor_ms = si["ram"]["postcopy-bytes"] / (16 * MiB) * 1000 * 0.8
            check(si["total-time"] > floor_ms, f"{src_kind}: postcopy not rate limited: {si}")


@test
def test_requested_pages_go_first_and_once():
    """With max-postcopy-bandwidth at 16 MiB/s the background walk reaches
    the end of a 64 MiB block after ~4 s; the last page, asked for once
    the package is in, comes long before: in the first half of the pages
    after the switch. Asked again, and asked for a page already sent,
    nothing is sent twice: every page after the switch exactly once."""
    last = SIZE - 4096
    with images(SIZE, "random") as imgs, peers("qmigd", "qmigd", imgs) as (s, _):
        def ask(c):
            c.sendall(req_pages_id(last, 4096) + req_pages(last, 4096) + req_pages(0, 8192))
        fake, si = fake_run(s, ask, 16 * MiB)
    check(fake.error is None, f"fake destination: {fake.error}")
    check(si["status"] == "completed", si)
    offsets = [o for o, _ in fake.after]
    check(len(offsets) == len(set(offsets)), "a page was sent twice after the switch")
    check(last in offsets, "the requested page never came")
    # Counted in pages, not seconds: half the block is 2 s of the walk at
    # its 16 MiB/s (4x the 0.5 s this allowed once), and a source serving
    # requests in walk order sends the last page last.
    at = offsets.index(last)
    check(at < SIZE // 4096 // 2, f"the requested page came as page {at} after the package")
    t_last = dict(fake.after)[last] - fake.package_at
    check(si["ram"]["postcopy-requests"] == 3, si["ram"])
    print(f"  requested page after {t_last * 1000:.0f} ms (page {at}), {len(offsets)} pages "
          f"after the switch, total {si['total-time']} ms")


BAD_REQUESTS = [
    ("misaligned", req_pages_id(100, 4096),
     "MIG_RP_MSG_REQ_PAGES: Misaligned page request, start:64 len: 4096"),
    ("no previous block", req_pages(0, 4096), "MIG_RP_MSG_REQ_PAGES has no previous block"),
    ("unknown block", req_pages_id(0, 4096, b"nope"), "MIG_RP_MSG_REQ_PAGES has no block 'nope'"),
    ("overrun", req_pages_id(SIZE - 4096, 8192),
     f"MIG_RP_MSG_REQ_PAGES request overrun, start={SIZE - 4096:x} len=2000 blocklen={SIZE:x}"),
    ("wrapping", req_pages_id(2**64 - 4096, 8192),
     f"MIG_RP_MSG_REQ_PAGES request overrun, start={2**64 - 4096:x} len=2000 "
     f"blocklen={SIZE:x}"),
    ("bad length", rp(3, struct.pack(">QIB", 0, 4096, 9) + b"mem"),
     "Req_Page_id with length 16 expecting 22"),
]


@test
def test_bad_page_requests_fail_the_source():
    """Each bad request fails the source with QEMU's words; the daemon
    then migrates again, byte-identical."""
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        for name, msg, want in BAD_REQUESTS:
            fake, si = fake_run(s, lambda c, m=msg: c.sendall(m), 1 * MiB)
            check(si["status"] == "failed", (name, si))
            check(want in si.get("error-desc", ""), (name, want, si))
            # The VM may run at the destination now: it is not resumed here.
            check(s.qmp.cmd("query-status")["status"] == "postmigrate", name)
            s.qmp.cmd("cont")
        s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 0})
        with_postcopy(d)
        port = start_incoming(d)
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(s, ("completed",), timeout=60)
        wait_status(d, ("completed",), timeout=60)
        check(files_equal(imgs[0][1], imgs[0][2]), "images differ after the bad requests")


if __name__ == "__main__":
    main()
