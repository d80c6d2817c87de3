#!/usr/bin/env python3
"""Live migration of a running guest: convergence under downtime-limit,
max-bandwidth, auto-converge, cancel, and no lost writes."""
import time

from itest import test, main, check
from fixtures import images, peers, MiB
from runner import Guest, start_incoming, wait_status, files_equal

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
            throttle_seen = 0
            deadline = time.monotonic() + timeout
            while True:
                info = src.status()
                throttle_seen = max(throttle_seen, info.get("cpu-throttle-percentage", 0))
                if info["status"] in ("completed", "failed", "cancelled"):
                    break
                check(time.monotonic() < deadline, f"no completion in {timeout}s: {info}")
                time.sleep(0.1)
            check(info["status"] == "completed", info)
            wait_status(dst, ("completed",), timeout=30)
            # The guest stays paused after the switchover: the source image is
            # frozen as it stood when the guest paused.
            rec = guest.record()
            check(rec[0] == 1 and rec[1] == 1, f"guest not paused: {rec}")
            written = guest.pages_written()
            time.sleep(0.3)
            check(guest.pages_written() == written, "guest still writing after completion")
            check(src.qmp.cmd("query-status")["status"] == "postmigrate")
            check(files_equal(s_img, d_img), "destination differs from the paused source")
            passes = [e for e in src.qmp.poll_events(0.2) if e["event"] == "MIGRATION_PASS"]
            return info, passes, throttle_seen, written
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
    with images(512 * MiB, "random") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        from runner import migrate
        info, _, _ = migrate(src, dst, True, 4, "multifd", max_bandwidth=100 * MiB)
        secs = (info["total-time"] - info["setup-time"]) / 1000
        rate = info["ram"]["transferred"] / secs
        print(f"    {rate / MiB:.1f} MiB/s for max-bandwidth 100 MiB/s")
        check(abs(rate - 100 * MiB) <= 10 * MiB, f"rate {rate / MiB:.1f} MiB/s")


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
            time.sleep(12)
            info = src.status()
            check(info["status"] == "active", info)
            check(info["ram"]["dirty-sync-count"] >= 2, info)
            check(info["expected-downtime"] > 300, f"expected-downtime {info['expected-downtime']}")
            check(info["ram"]["dirty-pages-rate"] > 0, info)
            src.qmp.cmd("migrate_cancel")
            wait_status(src, ("cancelled",), timeout=10, fail_on=("failed", "completed"))
            check(src.qmp.cmd("query-status")["status"] == "running")
            before = guest.pages_written()
            time.sleep(0.5)
            check(guest.pages_written() > before + 1000, "guest not running after cancel")
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
