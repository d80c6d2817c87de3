#!/usr/bin/env python3
"""Pages written and marked in the shared dirty bitmap after the first
round are sent again, and the destination ends equal to the source."""
import mmap
import os

from itest import test, main, check
from fixtures import images, peers, events_through, MiB
from waiting import wait_until
from runner import start_incoming, wait_status, files_equal, Peer, make_image, remove, unique_name

SIZE = 64 * MiB
PAGES = SIZE // 4096


def write_and_mark(image, pages, fill):
    """What a guest does: write the page, then set its bit (atomic OR is not
    needed here: this test is the only writer)."""
    with open(image, "r+b") as f, open(image + ".dirty", "r+b") as b:
        ram = mmap.mmap(f.fileno(), SIZE)
        bm = mmap.mmap(b.fileno(), (PAGES + 63) // 64 * 8)
        for p in pages:
            ram[p * 4096:(p + 1) * 4096] = fill(p)
            word = p // 64
            v = int.from_bytes(bm[word * 8:word * 8 + 8], "little") | (1 << (p % 64))
            bm[word * 8:word * 8 + 8] = v.to_bytes(8, "little")
        ram.close()
        bm.close()


def first_pages_sent(src):
    """True once the source has less than SIZE - 4 MiB left; raises if the
    migration ended first (the rewrite would come too late)."""
    info = src.status()
    check(info["status"] == "active", f"the migration left active before 4 MiB went: {info}")
    return info["ram"]["remaining"] < SIZE - 4 * MiB


@test
def test_redirtied_pages_are_sent_again():
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        _, s_img, d_img, _ = imgs[0]
        src.set_migration(True, 4, "multifd", 8 * MiB, events=True)
        dst.set_migration(True, 4)
        port = start_incoming(dst)
        src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        # The first pass goes in page order: once 4 MiB of it is sent, the
        # pages rewritten below (the first 2.1 MiB) were sent once already.
        wait_status(src, ("active",))
        wait_until("the first 4 MiB to be sent", lambda: first_pages_sent(src),
                   seen=lambda: src.status())
        rewritten = list(range(0, 256)) + list(range(512, 520))
        write_and_mark(s_img, rewritten,
                       lambda p: bytes(4096) if p >= 512 else os.urandom(4096))
        info = wait_status(src, ("completed",))
        wait_status(dst, ("completed",))
        ram = info["ram"]
        check(files_equal(s_img, d_img), "destination differs from the source")
        check(ram["normal"] + ram["duplicate"] == PAGES + len(rewritten),
              f"pages sent {ram['normal'] + ram['duplicate']}, want {PAGES + len(rewritten)}")
        check(ram["dirty-sync-count"] >= 3, ram)
        passes = [e["data"]["pass"] for e in events_through(src.qmp)
                  if e["event"] == "MIGRATION_PASS"]
        check(passes == list(range(1, ram["dirty-sync-count"] + 1)), passes)



@test
def test_side_files_removed_at_exit_unless_named_or_held():
    """IMAGE.dirty and IMAGE.ctl that qmigd created under their derived
    names go at exit; a file the user named, or one another process still
    has open, stays."""
    img = f"/dev/shm/{unique_name('side')}.ram"
    named_dirty, named_ctl = img + ".mine-dirty", img + ".mine-ctl"
    make_image(img, 4 * MiB, "sparse")
    try:
        src = Peer("qmigd", "source", [("mem", img, 4 * MiB)], "side")
        check(os.path.exists(img + ".dirty") and os.path.exists(img + ".ctl"), "no side files")
        src.stop()
        check(not os.path.exists(img + ".dirty"), "derived dirty bitmap left behind")
        check(not os.path.exists(img + ".ctl"), "derived control record left behind")

        src = Peer("qmigd", "source", [("mem", f"{img},dirty={named_dirty}", 4 * MiB)], "side",
                   extra=["--control", named_ctl])
        src.stop()
        check(os.path.exists(named_dirty) and os.path.exists(named_ctl), "named files removed")

        src = Peer("qmigd", "source", [("mem", img, 4 * MiB)], "side")
        with open(img + ".dirty", "rb"):  # a guest still holds the bitmap
            src.stop()
        check(os.path.exists(img + ".dirty"), "a bitmap another process holds was removed")
        check(not os.path.exists(img + ".ctl"), "the unused control record stayed")
    finally:
        remove(img, named_dirty, named_ctl)

if __name__ == "__main__":
    main()
