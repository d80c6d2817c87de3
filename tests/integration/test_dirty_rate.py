#!/usr/bin/env python3
"""calc-dirty-rate / query-dirty-rate (and HMP's calc_dirty_rate / info
dirty_rate) and query-migrationthreads against QEMU 10 -M none: answers,
errors and text; the rate of a `qmigd guest` dirtying at a known rate in
both modes; a measurement during a migration loses no page; the listed
threads are the real ones (/proc/PID/task)."""
import json
import os
import re
import time

from itest import test, main, check
from fixtures import images, peers, MiB
from runner import Guest, Peer, remove, unique_name, start_incoming, wait_status, files_equal

SIZE = 16 * MiB


def hmp(line):
    return json.dumps({"execute": "human-monitor-command", "arguments": {"command-line": line}})


def calc(**args):
    return json.dumps({"execute": "calc-dirty-rate", "arguments": args})


def query(**args):
    return json.dumps({"execute": "query-dirty-rate", "arguments": args})


# After a calc: until the measurement runs (QEMU 10 says `unstarted` until
# its thread has begun, which a loaded host can delay).
STARTED = "started"

# (request, what to compare, seconds to wait after it, or STARTED). "desc": same error
# text (or both succeed); "info": a query-dirty-rate answer, the same but
# for the time it started; "text": HMP text, the same but for numbers of
# seconds and milliseconds.
SCRIPT = [
    (query(), "info", 0),
    (query(**{"calc-time-unit": "millisecond"}), "info", 0),
    (query(**{"calc-time-unit": "minute"}), "desc", 0),
    ('{"execute": "calc-dirty-rate"}', "desc", 0),
    (calc(**{"calc-time": "1"}), "desc", 0),
    (calc(**{"calc-time": 1, "x": 1}), "desc", 0),
    (calc(**{"calc-time": 1, "sample-pages": "x", "mode": "bogus"}), "desc", 0),
    (calc(**{"calc-time": 1, "mode": "bogus"}), "desc", 0),
    (calc(**{"calc-time": 18446744073709551615}), "desc", 0),
    (calc(**{"calc-time": 0}), "desc", 0),
    (calc(**{"calc-time": 61}), "desc", 0),
    (calc(**{"calc-time": -1}), "desc", 0),
    (calc(**{"calc-time": 9223372036854775807}), "desc", 0),
    (calc(**{"calc-time": 49, "calc-time-unit": "millisecond"}), "desc", 0),
    (calc(**{"calc-time": 60001, "calc-time-unit": "millisecond"}), "desc", 0),
    (calc(**{"calc-time": 1, "mode": "dirty-ring"}), "desc", 0),
    (calc(**{"calc-time": 1, "mode": "dirty-bitmap", "sample-pages": 128}), "desc", 0),
    (calc(**{"calc-time": 1, "sample-pages": 127}), "desc", 0),
    (calc(**{"calc-time": 1, "sample-pages": 16385}), "desc", 0),
    (calc(**{"calc-time": 1, "sample-pages": -5}), "desc", 0),
    (calc(**{"calc-time": 1, "sample-pages": 1.5}), "desc", 0),
    (calc(**{"calc-time": 1}), "desc", STARTED),
    (query(), "info", 0),
    (calc(**{"calc-time": 1}), "desc", 0),  # one is measuring
    (hmp("calc_dirty_rate 1"), "text", 0),
    (hmp("info dirty_rate"), "text", 1.5),
    (query(), "info", 0),
    (query(**{"calc-time-unit": "millisecond"}), "info", 0),
    (hmp("info dirty_rate"), "text", 0),
    (calc(**{"calc-time": 300, "calc-time-unit": "millisecond", "mode": "dirty-bitmap"}), "desc", 0.8),
    (query(), "info", 0),
    (hmp("info dirty_rate"), "text", 0),
    (calc(**{"calc-time": 200, "calc-time-unit": "millisecond", "sample-pages": 16384}), "desc", 0.6),
    (query(), "info", 0),
    (hmp("help calc_dirty_rate"), "text", 0),
    (hmp("help info dirty_rate"), "text", 0),
    (hmp("calc_dirty_rate"), "text", 0),
    (hmp("calc_dirty_rate 0"), "text", 0),
    (hmp("calc_dirty_rate x"), "text", 0),
    (hmp("calc_dirty_rate -1"), "text", 0),
    (hmp("calc_dirty_rate -x 1"), "text", 0),
    (hmp("calc_dirty_rate -r 1"), "text", 0),
    (hmp("calc_dirty_rate -r -b 1"), "text", 0),
    (hmp("calc_dirty_rate -b -r 1"), "text", 0),
    (hmp("calc_dirty_rate -b 1 256"), "text", 0),
    (hmp("calc_dirty_rate 1 1"), "text", 0),
    (hmp("calc_dirty_rate 61"), "text", 0),
    (hmp("calc_dirty_rate 1 2 3"), "text", 0),
    (hmp("calc_dirty_rate 1 (2"), "text", 0),
    (hmp("calc_dirty_rate 1/0"), "text", 0),
    (hmp("calc_dirty_rate (0-1)"), "text", 0),
    (hmp("calc_dirty_rate -b 0x1"), "text", 1.3),
    (hmp("info dirty_rate"), "text", 0),
    ('{"execute": "query-migrationthreads"}', "value", 0),
    ('{"execute": "query-migrationthreads", "arguments": {"x": 1}}', "desc", 0),
]


def wait_rate_status(q, done):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not done(q.cmd("query-dirty-rate")["status"]):
        time.sleep(0.02)


def run_script(q):
    """Each line's reply; after a line with a wait, that long and then
    until no measurement runs (a loaded host can take longer than the
    measurement's own time to end it)."""
    replies = []
    for line, _, wait in SCRIPT:
        q.send_raw(line + "\n")
        replies.append(q.read_reply())
        if wait == STARTED:
            wait_rate_status(q, lambda st: st != "unstarted")
        elif wait:
            time.sleep(wait)
            wait_rate_status(q, lambda st: st != "measuring")
    return replies


def same(how, a, b):
    if ("error" in a) != ("error" in b):
        return False
    if "error" in a:
        return a["error"] == b["error"]
    ra, rb = a["return"], b["return"]
    if how == "info":
        # Both started within the script's seconds of each other.
        return (set(ra) == set(rb) and abs(ra["start-time"] - rb["start-time"]) < 60 and
                {k: v for k, v in ra.items() if k not in ("start-time", "calc-time")} ==
                {k: v for k, v in rb.items() if k not in ("start-time", "calc-time")} and
                abs(ra["calc-time"] - rb["calc-time"]) <= (200 if ra["calc-time-unit"] ==
                                                           "millisecond" else 0))
    if how == "text":
        return re.sub(r"Start Time: \d+", "Start Time: N", ra) == \
            re.sub(r"Start Time: \d+", "Start Time: N", rb)
    return how == "desc" or ra == rb


@test
def test_answers_errors_and_text_as_qemu():
    imgs = [f"/dev/shm/{unique_name('rate')}.ram" for _ in range(2)]
    qemu = ours = None
    try:
        qemu = Peer("qemu", "source", [("mem", imgs[0], SIZE)], "rate-q")
        ours = Peer("qmigd", "source", [("mem", imgs[1], SIZE)], "rate-o")
        rq, ro = run_script(qemu.qmp), run_script(ours.qmp)
        diffs = [f"{line}\n   QEMU:  {json.dumps(a)}\n   qmigd: {json.dumps(b)}"
                 for (line, how, _), a, b in zip(SCRIPT, rq, ro) if not same(how, a, b)]
        check(not diffs, "differences from QEMU 10:\n" + "\n".join(diffs))
    finally:
        for p in (qemu, ours):
            if p:
                p.stop()
        remove(*imgs)


def measure(src, guest, mode, seconds, **extra):
    """Starts a measurement and waits for it; returns (MB/s reported,
    MB/s the guest really wrote in that time)."""
    before = guest.pages_written()
    src.qmp.cmd("calc-dirty-rate", {"calc-time": seconds, "mode": mode, **extra})
    while True:
        time.sleep(0.1)
        info = src.qmp.cmd("query-dirty-rate", {"calc-time-unit": "millisecond"})
        if info["status"] == "measured":
            break
    written = guest.pages_written() - before
    # The guest's count spans the whole wait; the measurement its calc-time.
    return info["dirty-rate"], written * 4096 / MiB / ((info["calc-time"] + 100) / 1000), info


@test
def test_rate_of_a_known_guest_within_20_percent():
    """A guest writing 25600 pages/s (100 MiB/s) in sequence, each page
    once in the window: both modes report 100 MB/s within 20%."""
    rate_pages, want = 25600, 100
    with images(1024 * MiB, "sparse") as imgs, peers("qmigd", "qmigd", imgs) as (src, _):
        guest = Guest(imgs[0][1], rate=rate_pages, pattern="sequential", write_bytes=64)
        try:
            time.sleep(0.5)
            for mode, extra in (("dirty-bitmap", {}), ("page-sampling", {"sample-pages": 16384})):
                got, wrote, info = measure(src, guest, mode, 2, **extra)
                print(f"    {mode}: reported {got} MB/s, set {want}, guest wrote ~{wrote:.0f} MiB/s "
                      f"({info})")
                check(abs(got - want) <= want * 0.2 or
                      (abs(wrote - want) > want * 0.1 and abs(got - wrote) <= wrote * 0.2),
                      f"{mode}: {got} MB/s for a guest set to {want} (wrote ~{wrote:.0f})")
        finally:
            guest.stop()


@test
def test_measuring_during_a_migration_loses_no_page():
    """dirty-bitmap measurements back to back through a live migration: the
    pages they collect still reach the destination."""
    with images(256 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        _, s_img, d_img, _ = imgs[0]
        guest = Guest(s_img, rate=20000, pattern="hot", hot_set=32 * MiB, write_bytes=64)
        try:
            src.set_migration(True, 2, "multifd", 64 * MiB, extra_params={"downtime-limit": 300})
            dst.set_migration(True, 2)
            port = start_incoming(dst)
            src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            rates = []
            while src.status()["status"] not in ("completed", "failed", "cancelled"):
                if src.qmp.cmd("query-dirty-rate")["status"] != "measuring":
                    src.qmp.cmd("calc-dirty-rate", {"calc-time": 50, "calc-time-unit": "millisecond",
                                                    "mode": "dirty-bitmap"})
                    rates.append(src.qmp.cmd("query-dirty-rate").get("dirty-rate"))
                time.sleep(0.02)
            check(src.status()["status"] == "completed", src.status())
            wait_status(dst, ("completed",), timeout=30)
            check(len(rates) > 3, f"only {len(rates)} measurements")
            check(files_equal(s_img, d_img), "destination differs: a measurement took pages")
        finally:
            guest.stop()


def threads_during_migration(src_kind, dst_kind, channels=3):
    """query-migrationthreads of both sides while a multifd migration runs,
    each thread checked against /proc/PID/task."""
    with images(256 * MiB, "random") as imgs, peers(src_kind, dst_kind, imgs) as (src, dst):
        src.set_migration(True, channels, None, 16 * MiB)
        dst.set_migration(True, channels)
        port = start_incoming(dst)
        src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(src, ("active",), timeout=20)
        time.sleep(0.5)
        lists = {}
        for role, p in (("source", src), ("dest", dst)):
            listed = p.qmp.cmd("query-migrationthreads")
            for t in listed:
                comm = open(f"/proc/{p.proc.pid}/task/{t['thread-id']}/comm").read().strip()
                if p.kind == "qmigd":  # QEMU names its threads only with -name debug-threads=on
                    check(comm == t["name"][:15], f"{role} {t}: thread is named {comm}")
            lists[role] = sorted(t["name"] for t in listed)
        src.qmp.cmd("migrate_cancel")
        wait_status(src, ("cancelled",), timeout=20, fail_on=())
        time.sleep(0.3)
        after = src.qmp.cmd("query-migrationthreads")
        check(after == [], f"{src_kind} source lists threads after cancel: {after}")
        return lists


@test
def test_migration_threads_as_qemu():
    ours = threads_during_migration("qmigd", "qemu")
    theirs = threads_during_migration("qemu", "qmigd")
    want = ["mig/src/main", "mig/src/send_0", "mig/src/send_1", "mig/src/send_2"]
    check(theirs["source"] == want, f"QEMU 10 source lists {theirs['source']}")
    check(ours == {"source": want, "dest": []}, f"qmigd source, QEMU dest: {ours}")
    check(theirs["dest"] == [], f"qmigd dest lists {theirs['dest']}")


if __name__ == "__main__":
    main()
