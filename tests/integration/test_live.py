#!/usr/bin/env python3
"""Live migration of a running guest: convergence under downtime-limit,
max-bandwidth, auto-converge, cancel, and no lost writes."""
from itest import test, main, check
from fixtures import images, peers, MiB
from runner import Guest, start_incoming, wait_status, files_equal
from waiting import wait_until

GiB = 1024 * MiB


def live_migration(dst_kind, size, guest_args, params, caps=None, timeout=120):
    """Runs a migration with a guest dirtying the source; returns the
    source's final info, the pass events and the images."""
    with images(size, "mixed") as imgs, peers("qmigd", dst_kind, imgs) as (src, dst):
        _, s_img, d_img, _ = imgs[0]
        guest = Guest(s_img, **guest_args)
        try:
            caps = {"multifd": True, "events": True, **(caps or {})}
            for side in (src, dst):
                side.qmp.cmd("migrate-set-capabilities",
                             capabilities=[{"capability": k, "state": v} for k, v in caps.items()])
            src.qmp.cmd("migrate-set-parameters", params)
            dst.qmp.cmd("migrate-set-parameters",
                        {"multifd-channels": params.get("multifd-channels", 2)})
            port = start_incoming(dst)
            src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            seen = {"throttle": 0}

            def ended():
                info = seen["info"] = src.status()
                seen["throttle"] = max(seen["throttle"], info.get("cpu-throttle-percentage", 0))
                return info["status"] in ("completed", "failed", "cancelled")
            wait_until("the live migration to end", ended, timeout,
                       seen=lambda: seen["info"])
            info = seen["info"]
            check(info["status"] == "completed", info)
            wait_status(dst, ("completed",))
            # The guest stays paused after the switchover: the source image is
            # frozen as it stood when the guest paused. Paused is its ack in
            # the record (it writes nothing until asked to go on); that it
            # wrote nothing since is proved by the comparison after it (a
            # guest writing would make the source differ) and by the record:
            # pause asked and acked, no loop turn, no page, then as now.
            def still(r):
                pause_req, paused_ack, _, _, heartbeat, pages = r
                return pause_req, paused_ack, heartbeat, pages
            rec = still(guest.record())
            check(rec[:2] == (1, 1), f"guest not paused: {guest.record()}")
            check(src.qmp.cmd("query-status")["status"] == "postmigrate")
            check(files_equal(s_img, d_img), "destination differs from the paused source")
            check(still(guest.record()) == rec, f"guest went on after completion: {rec} -> "
                                                f"{guest.record()}")
            written = rec[3]
            # One MIGRATION_PASS per dirty sync; the last may still be on its way.
            def passes():
                return [e for e in src.qmp.poll_events() if e["event"] == "MIGRATION_PASS"]
            wait_until("a MIGRATION_PASS event per dirty sync",
                       lambda: len(passes()) >= info["ram"]["dirty-sync-count"],
                       seen=lambda: len(passes()))
            return info, passes(), seen["throttle"], written
        finally:
            guest.stop()


def converge(dst_kind):
    def fn():
        info, passes, _, written = live_migration(
            dst_kind, GiB, dict(rate=20000, pattern="hot", hot_set=64 * MiB),
            {"multifd-channels": 4, "max-bandwidth": 128 * MiB, "downtime-limit": 300})
        ram = info["ram"]
        check(ram["dirty-sync-count"] > 2, ram)
        check(len(passes) == ram["dirty-sync-count"], passes)
        # What downtime-limit (300 ms) bounds, with a 16x margin for a busy
        # machine: the switchover's own latency.
        check(0 < info["downtime"] < 5000, info)
        check(written > 10000, f"guest wrote only {written} pages")
        check(ram["normal"] + ram["duplicate"] > GiB // 4096, "no page was sent twice")
        print(f"    {dst_kind}: total {info['total-time']} ms, downtime {info['downtime']} ms, "
              f"passes {ram['dirty-sync-count']}, guest pages {written}")
    fn.__name__ = f"test_live_converges_to_{dst_kind}"
    test(fn)


converge("qmigd")
converge("qemu")


@test
def test_max_bandwidth_is_respected():
    """The rate since the migration began, by the daemon's clock (its
    total-time), taken while it is active: the switchover sends the last
    bandwidth x downtime-limit bytes unthrottled, as QEMU's
    ram_save_complete() does, and a busy machine's bursty bandwidth
    sample makes that share vary. The limit must hold (+10%), and be
    reached (-10%) where the daemon runs at full speed (not under a
    sanitizer)."""
    with images(512 * MiB, "random") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        from runner import migrate, SANITIZED
        mid = {}

        def sample(info):
            ram = info.get("ram", {})
            if info["status"] == "active" and ram.get("transferred", 0) < 0.8 * ram.get("total", 0):
                mid.update(info)
        migrate(src, dst, True, 4, "multifd", max_bandwidth=100 * MiB, progress=sample)
        check(mid.get("ram", {}).get("transferred", 0) > 0.5 * 512 * MiB,
              f"no sample of the active migration past half its RAM: {mid}")
        secs = (mid["total-time"] - mid["setup-time"]) / 1000
        rate = mid["ram"]["transferred"] / secs
        print(f"    {rate / MiB:.1f} MiB/s for max-bandwidth 100 MiB/s "
              f"(after {mid['ram']['transferred'] >> 20} MiB)")
        check(rate <= 110 * MiB, f"rate {rate / MiB:.1f} MiB/s")
        check(rate >= 90 * MiB or SANITIZED, f"rate {rate / MiB:.1f} MiB/s")


def start_hot_migration(src, dst, s_img, caps, params):
    for side in (src, dst):
        side.qmp.cmd("migrate-set-capabilities",
                     capabilities=[{"capability": k, "state": v} for k, v in caps.items()])
    src.qmp.cmd("migrate-set-parameters", params)
    dst.qmp.cmd("migrate-set-parameters", {"multifd-channels": 2})
    port = start_incoming(dst)
    src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")


@test
def test_dirty_rate_above_bandwidth_does_not_converge_and_cancel_keeps_guest_running():
    with images(256 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        _, s_img, _, _ = imgs[0]
        guest = Guest(s_img, rate=20000, pattern="hot", hot_set=128 * MiB)
        try:
            start_hot_migration(src, dst, s_img, {"multifd": True},
                                {"multifd-channels": 2, "max-bandwidth": 32 * MiB})
            # Not converging, told by its own passes: a dirty sync comes at
            # each pass's end, where the source would switch over if what
            # is dirty fitted in downtime-limit. Three after the setup's
            # (the bulk pass, then two over the hot set the guest keeps
            # dirtying) with the migration active all along: it declined
            # to converge at each.
            wait_status(src, ("active",))
            start = guest.pages_written()
            seen = {}

            def passes_declined():
                info = seen["info"] = src.status()
                check(info["status"] == "active", f"the migration left active: {info}")
                return info if info["ram"]["dirty-sync-count"] >= 4 else None
            info = wait_until("4 dirty syncs", passes_declined,
                              seen=lambda: seen["info"].get("ram"))
            check(guest.pages_written() > start, "the guest wrote nothing while migrating")
            check(info["expected-downtime"] > 300, f"expected-downtime {info['expected-downtime']}")
            check(info["ram"]["dirty-pages-rate"] > 0, info)
            src.qmp.cmd("migrate_cancel")
            wait_status(src, ("cancelled",), fail_on=("failed", "completed"))
            check(src.qmp.cmd("query-status")["status"] == "running")
            before = guest.pages_written()
            wait_until("the guest to write 1000 pages after the cancel",
                       lambda: guest.pages_written() > before + 1000,
                       seen=lambda: guest.record())
            check(guest.record()[2] == 0, "throttle left on")
        finally:
            guest.stop()


@test
def test_auto_converge_makes_it_converge():
    info, passes, throttle, _ = live_migration(
        "qmigd", 256 * MiB, dict(rate=20000, pattern="hot", hot_set=128 * MiB),
        {"multifd-channels": 2, "max-bandwidth": 32 * MiB, "cpu-throttle-initial": 50,
         "cpu-throttle-increment": 20},
        caps={"auto-converge": True}, timeout=150)
    check(throttle >= 50, f"throttle never reported ({throttle})")
    print(f"    converged with throttle {throttle}% after {info['ram']['dirty-sync-count']} passes, "
          f"total {info['total-time']} ms, downtime {info['downtime']} ms")


@test
def test_no_write_lost_when_hammering_until_pause():
    for _ in range(3):
        info, _, _, written = live_migration(
            "qmigd", 64 * MiB, dict(rate=200000, pattern="hot", hot_set=16 * 4096),
            {"multifd-channels": 2, "max-bandwidth": 0})
        check(written > 1000, written)


if __name__ == "__main__":
    main()
