#!/usr/bin/env python3
"""file: with the mapped-ram capability, against QEMU 10.

Every page has a fixed place in the file (a header per RAMBlock, a bitmap
of the pages written, pages 1 MiB-aligned), written by the main thread or
by each multifd channel through its own descriptor, and with direct-io
through O_DIRECT. Saved by one side and restored by the other, in every
direction, with and without multifd, with an offset, with direct-io on a
disk; a file saved with multifd restored without it; the capability
checks QEMU makes; and broken files: truncated, a wrong version or page
size, offsets outside the file, another RAM size or block name. A broken
file fails the load with a clear error-desc and the daemon loads a good
one after it."""
import contextlib
import os
import struct
import subprocess
import tempfile

from itest import test, main, check, skip
from fixtures import images, peers, MiB
from runner import unique_name, wait_status, remove, files_equal, Peer
from qmp import QMPError

SIZE = 32 * MiB
DISK_DIR = "/var/tmp"


def stream_file(directory="/dev/shm"):
    return os.path.join(directory, unique_name("mapped") + ".mig")


def resume(src):
    """A completed save leaves the VM paused (postmigrate), in QEMU too: a
    second save needs `cont` first."""
    if src.qmp.cmd("query-status")["status"] != "running":
        src.qmp.cmd("cont")


def save(src, uri, multifd, channels=4, zpd="multifd", direct_io=False):
    resume(src)
    src.set_migration(multifd, channels, zpd, 0, mapped_ram=True,
                      extra_params={"direct-io": direct_io})
    src.qmp.cmd("migrate", uri=uri)
    info = wait_status(src, ("completed", "failed"), timeout=120)
    check(info["status"] == "completed", f"save through {uri}: {info}")
    return info


def load(dst, uri, multifd, channels=4, direct_io=False, expect="completed"):
    dst.set_migration(multifd, channels, mapped_ram=True,
                      extra_params={"direct-io": direct_io})
    # QEMU quits after a failed load unless told not to.
    dst.qmp.cmd("migrate-incoming", uri=uri, **{"exit-on-error": False})
    info = wait_status(dst, ("completed", "failed"), timeout=120)
    check(info["status"] == expect, f"load through {uri}: {info}")
    return info


def save_load(src_kind, dst_kind, save_mf, load_mf, zpd="multifd", offset=None,
              directory="/dev/shm", direct_io=False, content="mixed", dest="fresh"):
    f = stream_file(directory)
    uri = f"file:{f}" + (f",offset={offset}" if offset else "")
    try:
        with images(SIZE, content, dest) as imgs, peers(src_kind, dst_kind, imgs) as (src, dst):
            save(src, uri, save_mf, zpd=zpd, direct_io=direct_io)
            load(dst, uri, load_mf, direct_io=direct_io)
            check(files_equal(imgs[0][1], imgs[0][2]),
                  f"{src_kind} -> {dst_kind} through mapped-ram {uri}: images differ")
    finally:
        remove(f)


DIRECTIONS = [("qemu", "qmigd"), ("qmigd", "qemu"), ("qmigd", "qmigd")]

for src_kind, dst_kind in DIRECTIONS:
    for mf in (False, True):
        def fn(src_kind=src_kind, dst_kind=dst_kind, mf=mf):
            save_load(src_kind, dst_kind, mf, mf, zpd="legacy" if not mf else "multifd")
        fn.__name__ = f"test_mapped_ram_{src_kind}_to_{dst_kind}_{'multifd4' if mf else 'plain'}"
        test(fn)


def direct_io_dir():
    d = tempfile.mkdtemp(prefix="qmigd-dio-", dir=DISK_DIR)
    probe = os.path.join(d, "probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as e:
        os.rmdir(d)
        skip(f"{DISK_DIR} takes no O_DIRECT ({e})", machine=True)
    os.unlink(probe)
    return d


for src_kind, dst_kind in DIRECTIONS:
    def fn(src_kind=src_kind, dst_kind=dst_kind):
        d = direct_io_dir()
        try:
            save_load(src_kind, dst_kind, True, True, directory=d, direct_io=True)
        finally:
            os.rmdir(d)
    fn.__name__ = f"test_mapped_ram_direct_io_{src_kind}_to_{dst_kind}"
    test(fn)


@test
def test_mapped_ram_with_offset_both_ways():
    save_load("qemu", "qmigd", True, True, offset="0x3000")
    save_load("qmigd", "qemu", False, False, offset="64k", zpd="none")


@test
def test_mapped_ram_saved_with_multifd_restored_without():
    save_load("qemu", "qmigd", True, False)
    save_load("qmigd", "qemu", True, False)


@test
def test_mapped_ram_restore_over_stale_memory():
    """qmigd restores into an image full of 0xAA: pages the file marks zero
    must be zero afterwards (QEMU starts from fresh memory; qmigd may not)."""
    save_load("qmigd", "qmigd", True, True, dest="garbage")
    save_load("qemu", "qmigd", False, False, dest="garbage", zpd="legacy")


@test
def test_mapped_ram_two_blocks():
    f = stream_file()
    try:
        with images(SIZE, "mixed", blocks=("mem", "vram")) as imgs, \
                peers("qmigd", "qmigd", imgs) as (src, dst):
            save(src, f"file:{f}", True)
            load(dst, f"file:{f}", True)
            for name, s, d, _ in imgs:
                check(files_equal(s, d), f"block {name} differs")
    finally:
        remove(f)


def try_cmd(peer, cmd, **args):
    try:
        peer.qmp.cmd(cmd, **args)
        return "accepted"
    except QMPError as e:
        return e.desc


@test
def test_mapped_ram_needs_a_file_as_qemu():
    seen = {}
    with images(4 * MiB, "zero") as imgs:
        for kind in ("qemu", "qmigd"):
            with peers(kind, kind, imgs) as (src, dst):
                src.set_migration(True, 2, mapped_ram=True)
                dst.set_migration(False, 2, mapped_ram=True)
                seen[kind] = [try_cmd(src, "migrate", uri="tcp:127.0.0.1:1"),
                              try_cmd(dst, "migrate-incoming", uri="tcp:127.0.0.1:0"),
                              try_cmd(src, "migrate", uri="exec:cat > /dev/null"),
                              try_cmd(src, "migrate", uri="fd:mig"),
                              try_cmd(dst, "migrate-incoming", uri="unix:/tmp/none.sock")]
    check(seen["qmigd"] == seen["qemu"], f"mapped-ram transports: {seen}")
    check(seen["qemu"][0] == "Migration requires seekable transport (e.g. file)", seen)


@test
def test_mapped_ram_capability_must_match():
    """A mapped-ram file loaded without the capability, and a plain stream
    loaded with it: both fail, on QEMU and on qmigd."""
    f, g = stream_file(), stream_file()
    try:
        with images(4 * MiB, "mixed") as imgs:
            with peers("qmigd", "qmigd", imgs) as (src, _):
                save(src, f"file:{f}", False)
                resume(src)
                src.set_migration(False, 2, mapped_ram=False)
                src.qmp.cmd("migrate", uri=f"file:{g}")
                wait_status(src, ("completed",), timeout=60)
            for kind in ("qemu", "qmigd"):
                with peers(kind, kind, imgs) as (_, dst):
                    dst.set_migration(False, 2, mapped_ram=False)
                    dst.qmp.cmd("migrate-incoming", uri=f"file:{f}", **{"exit-on-error": False})
                    info = wait_status(dst, ("completed", "failed"), timeout=60)
                    check(info["status"] == "failed", f"{kind} loaded mapped-ram without it")
                with peers(kind, kind, imgs) as (_, dst):
                    info = load(dst, f"file:{g}", False, expect="failed")
                    if kind == "qmigd":
                        check("Capability mapped-ram is on, but received capability is off"
                              in info.get("error-desc", ""), info)
    finally:
        remove(f, g)


def header_at(data, name, size):
    """File offset of a block's mapped-ram header: right after its MEM_SIZE
    entry (cstr8 name, be64 length)."""
    entry = bytes([len(name)]) + name.encode() + struct.pack(">Q", size)
    i = data.find(entry)
    check(i > 0, f"no MEM_SIZE entry for {name}")
    return i + len(entry)


def broken(path, how):
    with open(path, "r+b") as fh:
        data = fh.read(1 << 16)
        h = header_at(data, "mem", SIZE)
        version, page_size, bitmap_off, pages_off = struct.unpack(">IQQQ", data[h:h + 28])
        size = os.fstat(fh.fileno()).st_size
        if how == "truncated":
            fh.truncate(pages_off + SIZE // 2)
            return
        patch = {"version": struct.pack(">I", 2),
                 "page-size": struct.pack(">IQ", version, 65536),
                 "bitmap-outside": struct.pack(">IQQ", version, page_size, size + 4096),
                 "pages-outside": struct.pack(">IQQQ", version, page_size, bitmap_off,
                                              size // 4096 * 4096),
                 "pages-misaligned": struct.pack(">IQQQ", version, page_size, bitmap_off,
                                                 pages_off + 100)}[how]
        fh.seek(h)
        fh.write(patch)


BAD_FILES = {
    "truncated": "lie outside the file",
    "version": "Migration mapped-ram capability version not supported (expected <= 1, got 2)",
    "page-size": "has page size 0x10000, expected 0x1000",
    "bitmap-outside": "bitmap of block mem",
    "pages-outside": "pages of block mem",
    "pages-misaligned": "Error reading ramblock mem pages, region has bad alignment",
}


@test
def test_mapped_ram_broken_files():
    f = stream_file()
    try:
        with images(SIZE, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
            for how, says in BAD_FILES.items():
                save(src, f"file:{f}", True)
                broken(f, how)
                info = load(dst, f"file:{f}", True, expect="failed")
                check(says in info.get("error-desc", "-"), f"{how}: {info}")
                check(dst.proc.poll() is None, f"{how}: the destination died")
            save(src, f"file:{f}", True)  # and a good file still loads
            load(dst, f"file:{f}", True)
            check(files_equal(imgs[0][1], imgs[0][2]), "good load after broken ones differs")
    finally:
        remove(f)


@test
def test_mapped_ram_other_ram_size_or_name():
    f = stream_file()
    try:
        with images(SIZE, "mixed") as imgs, peers("qemu", "qmigd", imgs) as (src, _):
            save(src, f"file:{f}", True)
        for blocks, says in (([("mem", 2 * SIZE)], "Size mismatch"),
                             ([("other", SIZE)], 'Unknown ramblock "mem"')):
            paths = [(n, f"/dev/shm/{unique_name('dst')}.ram", z) for n, z in blocks]
            dst = Peer("qmigd", "dest", paths, "dst")
            try:
                info = load(dst, f"file:{f}", True, expect="failed")
                check(says in info.get("error-desc", ""), info)
            finally:
                dst.stop()
                remove(*[p for _, p, _ in paths])
    finally:
        remove(f)


@contextlib.contextmanager
def small_fs(fstype, size="2m"):
    """A small file system of our own (root only): a tmpfs to run out of
    space, a ramfs for a file system without O_DIRECT."""
    d = tempfile.mkdtemp(prefix=f"qmigd-{fstype}-", dir="/tmp")
    r = subprocess.run(["mount", "-t", fstype, "-o", f"size={size}", fstype, d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        skip(f"cannot mount a {fstype}: {r.stderr.strip()}", machine=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def failed_save(src, uri, direct_io):
    resume(src)
    src.set_migration(True, 2, mapped_ram=True, extra_params={"direct-io": direct_io})
    src.qmp.cmd("migrate", uri=uri)
    info = wait_status(src, ("failed", "completed"), timeout=30)
    check(info["status"] == "failed", f"{uri}: {info}")
    check(src.qmp.cmd("query-status")["status"] == "running", "the source stopped")
    return info.get("error-desc", "")


@test
def test_mapped_ram_save_that_cannot_write():
    """direct-io on a file system without O_DIRECT (ramfs) and a save into
    a full file system fail the migration with the reason; the source keeps
    running and then saves and restores fine."""
    f = stream_file()
    try:
        with images(4 * MiB, "random") as imgs, peers("qmigd", "qmigd", imgs) as (src, dst):
            with small_fs("ramfs") as d:
                desc = failed_save(src, f"file:{d}/vm.mig", True)
                check("O_DIRECT" in desc and "Invalid argument" in desc, desc)
            with small_fs("tmpfs") as d:
                desc = failed_save(src, f"file:{d}/vm.mig", False)
                check("No space left on device" in desc, desc)
            save(src, f"file:{f}", True)
            load(dst, f"file:{f}", True)
            check(files_equal(imgs[0][1], imgs[0][2]), "images differ")
    finally:
        remove(f)


if __name__ == "__main__":
    main()
