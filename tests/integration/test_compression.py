#!/usr/bin/env python3
"""multifd-compression zlib and zstd against QEMU 10, both ways.

Each method with its default level and a non-default one, QEMU 10 ->
qmigd, qmigd -> QEMU 10 and qmigd -> qmigd, byte-identical images; text
and mixed contents; each zero-page-detection mode; what query-migrate
counts. Then what must fail: a destination with another method or none
(QEMU's "flags received 2 flags expected 0" on both kinds of destination),
compression with mapped-ram (refused as QEMU refuses it), and hostile
compressed packets (garbage, a payload short of its pages, one with more
data than its pages, a payload size beyond any packet), each a `failed`
migration with a clear error-desc, after which the same destination
migrates again."""
import random
import socket
import zlib

import wire
from itest import test, main, check, cleanup
from fixtures import run_cell, images, peers, HeldPeers, MiB
from runner import start_incoming, wait_status, files_equal, migrate
from qmp import QMPError
from waiting import wait_until

SIZE = 64 * MiB
PAGE = 4096
DIRECTIONS = [("qemu", "qmigd"), ("qmigd", "qemu"), ("qmigd", "qmigd")]


def params(method, level=None):
    p = {"multifd-compression": method}
    if level is not None:
        p[f"multifd-{method}-level"] = level
    return p


def cell(src_kind, dst_kind, method, level, content="mixed", zpd="multifd", channels=4):
    def fn():
        info = run_cell(src_kind, dst_kind, SIZE, content, True, channels, zpd,
                        params=params(method, level))
        ram = info["ram"]
        check(ram["total"] == SIZE)
        # Compressed: the multifd bytes are well under the normal pages' bytes.
        if content == "text":
            check(ram["multifd-bytes"] < ram["normal-bytes"] // 2, ram)
    fn.__name__ = (f"test_{method}{'' if level is None else level}_{src_kind}_to_{dst_kind}"
                   f"_{content}_{zpd}_mf{channels}")
    test(fn)


for src_kind, dst_kind in DIRECTIONS:
    cell(src_kind, dst_kind, "zlib", None)
    cell(src_kind, dst_kind, "zstd", None)
    cell(src_kind, dst_kind, "zstd", 7, content="text")
    cell(src_kind, dst_kind, "zlib", 9, content="text")
for zpd in ("none", "legacy"):
    cell("qemu", "qmigd", "zstd", None, zpd=zpd, channels=2)
    cell("qmigd", "qemu", "zlib", None, zpd=zpd, channels=2)
cell("qmigd", "qmigd", "zlib", 0, content="random", channels=1)


def counters(src_kind):
    """query-migrate ram counters of a zstd migration from src_kind to qmigd."""
    return run_cell(src_kind, "qmigd", SIZE, "text", True, 2, "multifd",
                    params=params("zstd"))["ram"]


@test
def test_counters_as_qemu():
    ours, qemu = counters("qmigd"), counters("qemu")
    for key in ("total", "duplicate", "normal", "normal-bytes"):
        check(ours[key] == qemu[key], f"{key}: qmigd {ours[key]} vs QEMU {qemu[key]}")
    # Compressed sizes depend on packetisation; within a few percent.
    ratio = ours["multifd-bytes"] / qemu["multifd-bytes"]
    check(0.9 < ratio < 1.1, f"multifd-bytes qmigd {ours['multifd-bytes']} "
                             f"vs QEMU {qemu['multifd-bytes']}")


def mismatch(src_kind, dst_kind, src_method, dst_method, expect):
    """A source compressing with src_method into a destination set for
    dst_method: the destination fails with `expect`; afterwards both peers
    migrate again with matching methods."""
    with images(16 * MiB, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
        s.set_migration(True, 2, "multifd", extra_params=params(src_method))
        d.set_migration(True, 2, extra_params=params(dst_method))
        port = start_incoming(d)
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        info = wait_status(d, ("failed",), timeout=30, fail_on=("completed",))
        desc = info.get("error-desc", "")
        check(expect in desc, f"error-desc {desc!r} lacks {expect!r}")
        # Without a return path a source hears of the failure only through a
        # write that fails: a QEMU source that had written its whole (small)
        # stream before the destination reset the channels says `completed`
        # (seen under ASan, where the destination is slower), as it would
        # into a failing QEMU.
        ends = ("failed", "cancelled") + (("completed",) if s.kind == "qemu" else ())
        end = wait_status(s, ends, timeout=30, fail_on=())["status"]
        if s.kind == "qmigd":
            check(end == "failed", end)
        # A QEMU source that says completed is in postmigrate and refuses a
        # new migration ("Can't migrate the vm that was paused due to
        # previous migration") until `cont`, as after any completed one.
        if s.kind == "qmigd" or end == "completed":
            s.qmp.cmd("cont")
        migrate(s, d, True, 2, "multifd", params=params(dst_method))
        _, sp, dp, _ = imgs[0]
        check(files_equal(sp, dp), "the migration after the failed one differs")


@test
def test_zlib_source_into_plain_qmigd():
    mismatch("qmigd", "qmigd", "zlib", "none", "multifd: flags received 2 flags expected 0")


@test
def test_qemu_zstd_source_into_zlib_qmigd():
    mismatch("qemu", "qmigd", "zstd", "zlib", "multifd: flags received 4 flags expected 2")


@test
def test_qemu_destination_refuses_our_zlib_as_we_refuse_its():
    # QEMU's own words, on its own destination (it then hangs at the next
    # sync, wire-format doc 3.7, so only its error-desc is looked at).
    with images(16 * MiB, "mixed") as imgs, peers("qmigd", "qemu", imgs) as (s, d):
        s.set_migration(True, 2, "multifd", extra_params=params("zlib"))
        d.set_migration(True, 2, extra_params=params("none"))
        # QEMU quits after a failed load unless told otherwise.
        d.qmp.cmd("migrate-incoming", **{"uri": "tcp:127.0.0.1:0", "exit-on-error": False})
        port = int(d.status()["socket-address"][0]["port"])
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        desc = wait_until("QEMU 10 destination to say why it failed",
                          lambda: d.status().get("error-desc", ""), seen=d.status)
        check("flags received 2 flags expected 0" in desc, f"QEMU said {desc!r}")
        s.qmp.cmd("migrate_cancel")


@test
def test_compression_with_mapped_ram_refused_as_qemu():
    out = {}
    with images(4 * MiB, "zero") as imgs, peers("qemu", "qmigd", imgs) as (qemu, _), \
            peers("qmigd", "qemu", imgs) as (ours, _):
        for kind, peer in (("qemu", qemu), ("qmigd", ours)):
            peer.set_migration(True, 2, mapped_ram=True, extra_params=params("zstd"))
            try:
                peer.qmp.cmd("migrate", uri=f"file:/tmp/{kind}-never.mig")
                out[kind] = "accepted"
            except QMPError as e:
                out[kind] = str(e)
    check(out["qmigd"] == out["qemu"], out)
    check("Cannot use compression with mapped-ram" in out["qmigd"], out)


@test
def test_unknown_methods_refused_as_qemu():
    with images(4 * MiB, "zero") as imgs, peers("qemu", "qmigd", imgs) as (qemu, ours):
        for name in ("qpl", "uadk", "qatzip", "lz4"):
            errs = []
            for peer in (qemu, ours):
                try:
                    peer.qmp.cmd("migrate-set-parameters", **{"multifd-compression": name})
                    errs.append("accepted")
                except QMPError as e:
                    errs.append(str(e))
            check(errs[0] == errs[1], errs)


# --- hostile compressed packets, into one qmigd destination ---

class Hostile(HeldPeers):
    def __init__(self):
        super().__init__(16 * MiB, "mixed")

    def bad(self, packets, expect, method="zlib"):
        self.dst.set_migration(True, 2, extra_params=params(method))
        port = start_incoming(self.dst)
        socks = [socket.create_connection(("127.0.0.1", port))]
        socks[0].sendall(wire.good_start(self.size))
        for i in range(2):
            socks.append(socket.create_connection(("127.0.0.1", port)))
            socks[-1].sendall(wire.multifd_init(i))
        socks[1].sendall(packets)
        try:
            info = wait_status(self.dst, ("failed",), timeout=60, fail_on=("completed",))
        finally:
            for s in socks:
                s.close()
        desc = info.get("error-desc", "")
        check(expect in desc, f"error-desc {desc!r} lacks {expect!r}")
        check(desc in self.dst.log_text(), "the failure was not logged")
        # Nothing outside the image, and the daemon migrates again.
        _, sp, dp, _ = self.imgs[0]
        migrate(self.src, self.dst, True, 2, "multifd", params=params(method))
        check(files_equal(sp, dp), "good migration after a bad one differs")
        self.src.qmp.cmd("cont")


H = None


def hostile(name, make, expect, method="zlib"):
    def fn():
        global H
        if H is None:
            H = Hostile()
        H.bad(make(), expect, method)
    fn.__name__ = "test_hostile_" + name
    test(fn)


def deflated(data, cut=0):
    c = zlib.compressobj(1)
    z = c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)
    return z[:len(z) - cut]


def zpacket(pages, payload, flags=2):
    offsets = [i * PAGE for i in range(pages)]
    return wire.multifd_packet(offsets, pages, flags=flags, next_size=len(payload)) + payload


rnd = random.Random(5).randbytes
hostile("zlib_garbage", lambda: zpacket(2, rnd(3000)), "inflate returned")
hostile("zlib_too_few_pages", lambda: zpacket(3, deflated(b"\1" * 2 * PAGE)),
        "inflate generated too few output")
hostile("zlib_more_than_its_pages", lambda: zpacket(1, deflated(b"\1" * 2 * PAGE)),
        "packet inflates to more than its 1 pages")
hostile("zlib_truncated", lambda: zpacket(2, deflated(rnd(2 * PAGE), cut=100)),
        "inflate")
hostile("payload_beyond_any_packet",
        lambda: wire.multifd_packet([0], 1, flags=2, next_size=2 * 128 * PAGE + 1),
        "next_packet_size 1048577 for 1 pages")
hostile("uncompressed_packet_into_zlib", lambda: wire.multifd_packet([0], 1) + b"\1" * PAGE,
        "multifd: flags received 0 flags expected 2")
hostile("zstd_garbage", lambda: zpacket(2, rnd(3000), flags=4), "decompressStream", "zstd")


@cleanup
def remove_shared():
    if H:
        H.close()


if __name__ == "__main__":
    main()
