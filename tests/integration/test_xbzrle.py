#!/usr/bin/env python3
"""xbzrle: pages the guest rewrites go as deltas against the copy sent
before. qmigd -> QEMU 10 and qmigd -> qmigd with a workload changing a few
words of its pages; QEMU 10 -> qmigd with a real Linux guest whose RAM is a
shared file, parked, the parked image compared with the guest's. Both
ends' xbzrle counters must move and the images be byte-identical."""
import os
import shutil
import tempfile

from itest import test, main, check, skip
import linux_guest as lg
from fixtures import images, peers, MiB
from runner import Guest, Peer, start_incoming, wait_status, files_equal, unique_name, remove
from waiting import wait_until

SIZE = 64 * MiB
XBZRLE = [{"capability": "xbzrle", "state": True}]


def run_with_workload(dst_kind, xbzrle=True):
    """A guest changing 64 bytes of pages in a 16 MiB hot set, 20000 pages/s,
    at 24 MiB/s: several rounds before it converges, held there by a 1 ms
    downtime-limit until 1000 pages went as deltas (its rate alone did not
    hold it beside a CPU hog, which slows the guest: one round of misses,
    then the switchover)."""
    with images(SIZE, "mixed") as imgs, peers("qmigd", dst_kind, imgs) as (s, d):
        _, s_img, d_img, _ = imgs[0]
        guest = Guest(s_img, rate=20000, pattern="hot", hot_set=16 * MiB, write_bytes=64)
        try:
            for p in (s, d):
                p.qmp.cmd("migrate-set-capabilities", capabilities=[
                    {"capability": "xbzrle", "state": xbzrle}])
            s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 24 * MiB,
                                                 "zero-page-detection": "legacy",
                                                 "xbzrle-cache-size": 32 * MiB,
                                                 "downtime-limit": 1})
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{start_incoming(d)}")
            if xbzrle:
                def deltas_or_end():
                    info = s.status()
                    return (info["status"] in ("completed", "failed") or
                            info.get("xbzrle-cache", {}).get("pages", 0) > 1000)
                wait_until("1000 pages sent as xbzrle deltas", deltas_or_end, timeout=120,
                           seen=lambda: s.status().get("xbzrle-cache"))
            s.qmp.cmd("migrate-set-parameters", {"downtime-limit": 2000})
            si = wait_status(s, ("completed",), 120)
            wait_status(d, ("completed",), 30)
            check(files_equal(s_img, d_img), "images differ")
            return si, s.qmp.hmp("info migrate")
        finally:
            guest.stop()


def xbzrle_cell(dst_kind):
    def fn():
        si, hmp = run_with_workload(dst_kind)
        x = si["xbzrle-cache"]
        check(x["cache-size"] == 32 * MiB, x)
        check(x["pages"] > 1000 and x["bytes"] > 0 and x["cache-miss"] > 0, x)
        # 64 changed bytes cost about 70: far below a page.
        check(x["bytes"] < x["pages"] * 512, x)
        check("xbzrle pages: " in hmp and "cache size: 33554432 bytes" in hmp, hmp)
        print(f"  {x['pages']} pages as deltas ({x['bytes'] >> 10} KiB), {x['cache-miss']} "
              f"misses, {x['overflow']} overflows; {si['ram']['transferred'] >> 20} MiB sent, "
              f"{si['ram']['dirty-sync-count']} syncs")
    fn.__name__ = f"test_qmigd_to_{dst_kind}"
    test(fn)


xbzrle_cell("qemu")
xbzrle_cell("qmigd")


@test
def test_qemu_guest_to_qmigd_parked():
    """A Linux guest on QEMU 10 (its RAM a shared file) parked by a qmigd
    destination over several xbzrle rounds: QEMU's xbzrle counters move,
    and the parked RAM image is the guest's, byte for byte."""
    work = tempfile.mkdtemp(prefix="qmigd-xbzrle-", dir="/dev/shm")
    ram = f"/dev/shm/{unique_name('xbzrle-guest')}.ram"
    guest = park = None
    try:
        try:
            lg.kernel_path()
            rd = lg.build_initramfs(work)
            guest = lg.boot(rd, "xbzrle-guest", log_dir=work, extra=[
                "-object", f"memory-backend-file,id=pc.ram,size=512M,mem-path={ram},share=on",
                "-machine", "memory-backend=pc.ram"])
        except lg.Unavailable as why:
            skip(str(why))
        d = tempfile.mkdtemp(prefix="vm-", dir=work)
        park = Peer("qmigd", "dest", [], "xbzrle-park", extra=["--ram-dir", d])
        guest.qmp.cmd("migrate-set-capabilities", capabilities=XBZRLE)
        guest.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 16 * MiB, "downtime-limit": 1,
                                                 "zero-page-detection": "legacy"})
        guest.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{start_incoming(park)}")
        # Rounds go on while the guest rewrites its pages (no switchover
        # within 1 ms); once QEMU sent some as deltas, it may switch over.
        def deltas_or_end():
            info = guest.status()
            return (info["status"] in ("completed", "failed") or
                    info.get("xbzrle-cache", {}).get("pages", 0) > 100)
        wait_until("QEMU to send 100 pages as xbzrle deltas", deltas_or_end, timeout=180,
                   every=0.2, seen=lambda: guest.status().get("xbzrle-cache"))
        guest.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 1 << 30, "downtime-limit": 2000})
        si = wait_status(guest, ("completed",), 180)
        wait_status(park, ("completed",), 30)
        x = si["xbzrle-cache"]
        check(x["pages"] > 0 and x["cache-miss"] > 0, x)
        check(files_equal(ram, os.path.join(d, "00-pc.ram.img")), "the parked RAM differs")
        print(f"  QEMU sent {x['pages']} pages as xbzrle ({x['bytes'] >> 10} KiB, "
              f"{x['overflow']} overflows) in {si['ram']['dirty-sync-count']} syncs")
    finally:
        for p in (guest, park):
            if p:
                p.stop()
        remove(ram)
        shutil.rmtree(work, True)


if __name__ == "__main__":
    main()
