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
from waiting import wait_until

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
# After a line: until the last measurement has ended (`measured`; a calc
# sets `unstarted` or `measuring` at once, a refused one leaves `measured`).
MEASURED = "measured"

# (request, what to compare, what to wait for after it: 0 for nothing,
# STARTED or MEASURED). "desc": same error text (or both succeed); "info": a
# query-dirty-rate answer, the same but for when it started and how long
# it really took; "text": HMP text, the same but for the start time.
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
    # 3 s: long enough that the next three lines find it still measuring,
    # however late a loaded host runs them.
    (calc(**{"calc-time": 3}), "desc", STARTED),
    (query(), "info", 0),
    (calc(**{"calc-time": 1}), "desc", 0),  # one is measuring
    (hmp("calc_dirty_rate 1"), "text", 0),
    (hmp("info dirty_rate"), "text", MEASURED),
    (query(), "info", 0),
    (query(**{"calc-time-unit": "millisecond"}), "info", 0),
    (hmp("info dirty_rate"), "text", 0),
    (calc(**{"calc-time": 300, "calc-time-unit": "millisecond", "mode": "dirty-bitmap"}), "desc", MEASURED),
    (query(), "info", 0),
    (hmp("info dirty_rate"), "text", 0),
    (calc(**{"calc-time": 200, "calc-time-unit": "millisecond", "sample-pages": 16384}), "desc", MEASURED),
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
    (hmp("calc_dirty_rate -b 0x1"), "text", MEASURED),
    (hmp("info dirty_rate"), "text", 0),
    ('{"execute": "query-migrationthreads"}', "value", 0),
    ('{"execute": "query-migrationthreads", "arguments": {"x": 1}}', "desc", 0),
]


def wait_rate_status(q, want):
    """Until query-dirty-rate's status is `want` (STARTED: anything but
    `unstarted`)."""
    def reached():
        st = q.cmd("query-dirty-rate")["status"]
        return st != "unstarted" if want == STARTED else st == want
    wait_until(f"query-dirty-rate to say {want}", reached,
               seen=lambda: q.cmd("query-dirty-rate")["status"])


def run_script(q):
    """Each line's reply; after a line with a wait, until that state (a
    loaded host can take longer than the measurement's own time to end
    it)."""
    replies = []
    for line, _, wait in SCRIPT:
        q.send_raw(line + "\n")
        replies.append(q.read_reply())
        if wait:
            wait_rate_status(q, wait)
    return replies


def same(how, a, b, span):
    """Whether replies a (QEMU's) and b (ours) agree; `span`: the unix
    seconds the two runs lay in."""
    if ("error" in a) != ("error" in b):
        return False
    if "error" in a:
        return a["error"] == b["error"]
    ra, rb = a["return"], b["return"]
    if how == "info":
        # Start times: the same (none yet), or both in the runs' time.
        # calc-time: each run's real duration, the same to within a loaded
        # host's late wake-ups (several 100 ms): in seconds the same, in
        # milliseconds within half (a wrong unit is 1000 times off).
        def when(r):
            return span[0] <= r["start-time"] <= span[1]

        def took(x, y):
            return x == y if ra["calc-time-unit"] == "second" else \
                abs(x - y) <= max(200, min(x, y) // 2)
        return (set(ra) == set(rb) and
                (ra["start-time"] == rb["start-time"] or when(ra) and when(rb)) and
                {k: v for k, v in ra.items() if k not in ("start-time", "calc-time")} ==
                {k: v for k, v in rb.items() if k not in ("start-time", "calc-time")} and
                took(ra["calc-time"], rb["calc-time"]))
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
        begun = int(time.time())
        rq, ro = run_script(qemu.qmp), run_script(ours.qmp)
        span = (begun, time.time() + 1)
        diffs = [f"{line}\n   QEMU:  {json.dumps(a)}\n   qmigd: {json.dumps(b)}"
                 for (line, how, _), a, b in zip(SCRIPT, rq, ro) if not same(how, a, b, span)]
        check(not diffs, "differences from QEMU 10:\n" + "\n".join(diffs))
    finally:
        for p in (qemu, ours):
            if p:
                p.stop()
        remove(*imgs)


def counted(guest):
    """(time before, pages the guest says it wrote, time after): the count
    is the guest's own at some moment between the two times."""
    t0 = time.monotonic()
    pages = guest.pages_written()
    return t0, pages, time.monotonic()


def measure(src, guest, mode, seconds, **extra):
    """Runs one measurement while reading the guest's own count of pages
    written; returns (MB/s reported, (least, most) MB/s the guest wrote in
    the measurement's window, info). The window, as long as the reported
    calc-time, lies somewhere between the calc and the answer that said
    `measured`: it holds at least the pages of the stretch every such
    window covers, at most those of the whole stretch. On an idle host the
    two bounds are a few percent apart; a loaded one widens them, it does
    not make them wrong."""
    reads = [counted(guest)]
    src.qmp.cmd("calc-dirty-rate", {"calc-time": seconds, "mode": mode, **extra})

    def measured():
        info = src.qmp.cmd("query-dirty-rate", {"calc-time-unit": "millisecond"})
        reads.append(counted(guest))
        return info if info["status"] == "measured" else None
    info = wait_until(f"the {mode} measurement to end", measured)
    took = info["calc-time"] / 1000
    first, last = reads[0][2], reads[-1][0]  # the window is in [first, last]
    inner = (last - took, first + took)      # ... and covers this, if it is one
    most = reads[-1][1] - reads[0][1]
    least = 0
    if inner[0] < inner[1]:
        least = max(0, max(n for _, n, after in reads if after <= inner[1]) -
                    min(n for before, n, _ in reads if before >= inner[0]))
    rate = 4096 / MiB / took
    return info["dirty-rate"], (least * rate, most * rate), info


@test
def test_rate_of_a_known_guest_within_20_percent():
    """A guest writing 25600 pages/s (100 MiB/s) in sequence, each page
    once in the window: both modes report what it wrote (by its own count)
    in the measured time, within 20%."""
    rate_pages, want = 25600, 100
    with images(1024 * MiB, "sparse") as imgs, peers("qmigd", "qmigd", imgs) as (src, _):
        guest = Guest(imgs[0][1], rate=rate_pages, pattern="sequential", write_bytes=64)
        try:
            for mode, extra in (("dirty-bitmap", {}), ("page-sampling", {"sample-pages": 16384})):
                got, (least, most), info = measure(src, guest, mode, 2, **extra)
                print(f"    {mode}: reported {got} MB/s, set {want}, guest wrote "
                      f"{least:.0f}-{most:.0f} MiB/s ({info})")
                # 20%: page-sampling's sampling error and the time its
                # hashing takes; 1 for the whole MB/s reported.
                check(least * 0.8 - 1 <= got <= most * 1.2 + 1,
                      f"{mode}: {got} MB/s for a guest that wrote {least:.0f}-{most:.0f} MiB/s")
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

            def measuring_until_the_end():
                """A new 50 ms measurement whenever none runs; the
                migration's final status once it has one."""
                st = src.status()["status"]
                if st in ("completed", "failed", "cancelled"):
                    return st
                if src.qmp.cmd("query-dirty-rate")["status"] != "measuring":
                    src.qmp.cmd("calc-dirty-rate", {"calc-time": 50, "calc-time-unit": "millisecond",
                                                    "mode": "dirty-bitmap"})
                    rates.append(src.qmp.cmd("query-dirty-rate").get("dirty-rate"))
                return None
            end = wait_until("the migration to end", measuring_until_the_end, timeout=300)
            check(end == "completed", src.status())
            wait_status(dst, ("completed",), timeout=30)
            check(len(rates) > 3, f"only {len(rates)} measurements")
            check(files_equal(s_img, d_img), "destination differs: a measurement took pages")
        finally:
            guest.stop()


def migration_tasks(peer):
    """The names of peer's threads that are migration threads (mig/...),
    as /proc/PID/task has them: qmigd names its threads, QEMU does so only
    with -name debug-threads=on."""
    names = []
    task = f"/proc/{peer.proc.pid}/task"
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # a thread that ended
    return sorted(n for n in names if n.startswith("mig/"))


def threads_during_migration(src_kind, dst_kind, channels=3):
    """query-migrationthreads of both sides while a multifd migration runs,
    each thread checked against /proc/PID/task."""
    with images(256 * MiB, "random") as imgs, peers(src_kind, dst_kind, imgs) as (src, dst):
        src.set_migration(True, channels, None, 16 * MiB)
        dst.set_migration(True, channels)
        port = start_incoming(dst)
        src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(src, ("active",), timeout=20)
        # Each thread lists itself once it runs: until the main one and
        # every sender have (a source that lists fewer fails here, saying
        # what it listed).
        wait_until(f"{src_kind} source to list {channels + 1} threads",
                   lambda: len(src.qmp.cmd("query-migrationthreads")) >= channels + 1,
                   seen=lambda: src.qmp.cmd("query-migrationthreads"))
        if dst.kind == "qmigd":  # the receivers it must not list are there
            wait_until(f"qmigd destination's {channels} receiving threads",
                       lambda: sum(n.startswith("mig/dst/recv_") for n in migration_tasks(dst))
                       >= channels, seen=lambda: migration_tasks(dst))
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
        if src.kind == "qmigd":
            # Once its threads have ended, none may be listed.
            wait_until("qmigd source's migration threads to end",
                       lambda: not migration_tasks(src), seen=lambda: migration_tasks(src))
            after = src.qmp.cmd("query-migrationthreads")
            check(after == [], f"qmigd source lists threads after cancel: {after}")
        else:
            # QEMU 10 says cancelled before its threads end and unlist
            # themselves (migrate_fd_cleanup joins them).
            wait_until("QEMU 10 source to list no thread after cancel",
                       lambda: src.qmp.cmd("query-migrationthreads") == [],
                       seen=lambda: src.qmp.cmd("query-migrationthreads"))
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
