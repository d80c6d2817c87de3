#!/usr/bin/env python3
"""Pages written and marked in the shared dirty bitmap after the first
round are sent again, and the destination ends equal to the source."""
import mmap
import os
import time

from itest import test, main, check
from fixtures import images, peers, MiB
from runner import start_incoming, wait_status, files_equal

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


@test
def test_redirtied_pages_are_sent_again():
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
        _, s_img, d_img, _ = imgs[0]
        src.set_migration(True, 4, "multifd", 8 * MiB, events=True)
        dst.set_migration(True, 4)
        port = start_incoming(dst)
        src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(src, ("active",), timeout=10)
        time.sleep(1.5)  # ~12 MiB sent: the first pages are done
        remaining = src.status()["ram"]["remaining"]
        check(remaining < SIZE - 4 * MiB, f"first pages not sent yet ({remaining})")
        rewritten = list(range(0, 256)) + list(range(512, 520))
        write_and_mark(s_img, rewritten,
                       lambda p: bytes(4096) if p >= 512 else os.urandom(4096))
        info = wait_status(src, ("completed",), timeout=60)
        wait_status(dst, ("completed",), timeout=10)
        ram = info["ram"]
        check(files_equal(s_img, d_img), "destination differs from the source")
        check(ram["normal"] + ram["duplicate"] == PAGES + len(rewritten),
              f"pages sent {ram['normal'] + ram['duplicate']}, want {PAGES + len(rewritten)}")
        check(ram["dirty-sync-count"] >= 3, ram)
        passes = [e["data"]["pass"] for e in src.qmp.poll_events(0.2) if e["event"] == "MIGRATION_PASS"]
        check(passes == list(range(1, ram["dirty-sync-count"] + 1)), passes)


if __name__ == "__main__":
    main()
