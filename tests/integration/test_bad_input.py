#!/usr/bin/env python3
"""Broken peers against qmigd dest: each ends `failed` with an error-desc,
the daemon keeps answering, and the same daemon then completes a good
migration from a qmigd source."""
import os
import random
import socket

import wire
from itest import test, main, check, cleanup
from fixtures import HeldPeers, MiB
from runner import Peer, start_incoming, wait_status, files_equal, migrate
from waiting import wait_until

SIZE = 16 * MiB


class Harness(HeldPeers):
    """One destination daemon (and a qmigd source for the good runs)."""

    def __init__(self):
        super().__init__(SIZE, "mixed")

    def bad(self, multifd, channels, send, expect):
        """Arms the dest, lets `send(port)` misbehave, checks failure, then a good run."""
        self.dst.set_migration(multifd, channels)
        port = start_incoming(self.dst)
        held = send(port)
        info = wait_status(self.dst, ("failed",), timeout=60, fail_on=("completed",))
        # Sockets a case keeps open close only now, so the failure under test
        # is not raced by an end-of-stream on another channel.
        for sock in held if isinstance(held, list) else []:
            sock.close()
        desc = info.get("error-desc", "")
        check(expect in desc, f"error-desc {desc!r} lacks {expect!r}")
        check("socket-address" not in info or info["status"] == "failed")
        log = self.dst.log_text()
        check(desc in log, "the failure was not logged")
        hmp = self.dst.qmp.cmd("human-monitor-command", **{"command-line": "info migrate"})
        check(desc in hmp, f"info migrate lacks the error: {hmp!r}")
        # Still serving, and a good migration works on the same daemon.
        check(self.dst.qmp.cmd("query-status")["status"] == "inmigrate")
        _, name_src, name_dst, _ = self.imgs[0]
        with open(name_dst, "r+b") as f:
            f.write(b"\xee" * PAGE_SPAN)
        src_info, dst_info, _ = migrate(self.src, self.dst, True, 2, "multifd")
        check(files_equal(name_src, name_dst), "good migration after a bad one differs")
        # A fresh source for the next case: a completed source is postmigrate.
        self.src.qmp.cmd("cont")


PAGE_SPAN = 64 * 4096
H = None


def connect(port, data=b"", close=True):
    s = socket.create_connection(("127.0.0.1", port))
    if data:
        s.sendall(data)
    if close:
        s.close()
    return s


def case(name, multifd, channels, send, expect):
    def fn():
        global H
        if H is None:
            H = Harness()
        H.bad(multifd, channels, send, expect)
    fn.__name__ = "test_" + name
    test(fn)


good_start = wire.good_start(SIZE)

case("wrong_magic", False, 1, lambda p: connect(p, wire.header(magic=0x12345678)),
     "Not a migration stream")
case("wrong_version", False, 1, lambda p: connect(p, wire.header(version=2) + wire.config()),
     "SaveVM v2 format is obsolete")
case("machine_mismatch", False, 1, lambda p: connect(p, wire.header() + wire.config("pc")),
     "Machine type received is 'pc' and local is 'none'")
# Names off the wire that are not UTF-8 must not reach a reply raw.
case("machine_not_utf8", False, 1,
     lambda p: connect(p, wire.header() + b"\x07" + wire.be32(3) + b"\xff\xfe\x01"),
     "Machine type received is '\\xff\\xfe\\x01' and local is 'none'")
case("ramblock_not_utf8", False, 1,
     lambda p: connect(p, wire.header() + wire.config() + wire.start() + wire.be64(SIZE | 4) +
                       b"\x03\xc3\x28\x80" + wire.be64(SIZE)),
     'Unknown ramblock "\\xc3(\\x80"')
case("unknown_section", False, 1,
     lambda p: connect(p, wire.header() + wire.config() + wire.start("nosuch")),
     "Unknown savevm section or instance 'nosuch' 0")
case("unknown_ramblock", False, 1,
     lambda p: connect(p, wire.header() + wire.config() + wire.start() +
                       wire.mem_size([("nosuch", SIZE)])),
     'Unknown ramblock "nosuch"')
case("size_mismatch", False, 1,
     lambda p: connect(p, wire.header() + wire.config() + wire.start() +
                       wire.mem_size([("mem", 2 * SIZE)])),
     "Size mismatch: mem: 0x2000000 != 0x1000000")
case("offset_out_of_range", False, 1,
     lambda p: connect(p, good_start + wire.part() + wire.page(SIZE, b"\1" * 4096)),
     "Illegal RAM offset 1000000")
case("truncated_page", False, 1,
     lambda p: connect(p, good_start + wire.part() + wire.page(0, b"\1" * 100)),
     "unexpected end of migration stream")
case("disconnect_midway", False, 1, lambda p: connect(p, good_start),
     "unexpected end of migration stream")
case("random_bytes_main", False, 1, lambda p: connect(p, random.Random(1).randbytes(8192)),
     "Not a migration stream")


EXTRA = "Extra incoming migration connection; ignoring"
NOT_OURS = "ignored a connection that is no channel of this migration"


def ignored_then_main_ends(p, main, channels=(), before=None, extra=None):
    """The main channel `main`; `before(port)`, connections that are no
    channel of this migration, ignored (what it returns is held open); the
    multifd channels of ids `channels`, the status active; `extra(port)`, connections past the channels, ignored as
    QEMU 10 ignores them. When the main channel then ends, the error says
    what was ignored."""
    m = connect(p, main, close=False)
    held = []
    if before:
        held += before(p) or []
        wait_until("the connection to be ignored", lambda: NOT_OURS in H.dst.log_text())
    held += [connect(p, wire.multifd_init(i), close=False) for i in channels]
    wait_status(H.dst, ("active",), timeout=60)
    if extra:
        extra(p)
        wait_until("the extra connection to be ignored", lambda: EXTRA in H.dst.log_text())
    check(H.dst.status()["status"] == "active", "an ignored connection ended the migration")
    m.close()
    return held


case("extra_channel_without_multifd", False, 1,
     lambda p: ignored_then_main_ends(p, wire.header(), extra=lambda p: connect(p, wire.header())),
     "unexpected end of migration stream (a connection was ignored: a second main channel came")


def multifd_then(p, channels, packets, main_extra=b"", close_channels=False):
    """Connects main + channels, sends packets on channel 0; returns the
    sockets still open (closed by the harness once the failure is seen)."""
    m = connect(p, good_start + main_extra, close=False)
    socks = [connect(p, wire.multifd_init(i), close=False) for i in range(channels)]
    socks[0].sendall(packets)
    if close_channels:
        for s in socks:
            s.close()
        return [m]
    return socks + [m]


# Inits that are not this migration's are ignored (a stranger's copy
# cannot end it); a load that then fails names the first.
def not_ours_then_main_ends(init):
    return lambda p: ignored_then_main_ends(p, good_start, channels=(0, 1),
                                            before=lambda p: connect(p, init) and None)


case("multifd_uuid_mismatch", True, 2, not_ours_then_main_ends(wire.multifd_init(0, b"\1" * 16)),
     "multifd: received uuid '01010101-0101-0101-0101-010101010101'")
case("multifd_channel_id_too_big", True, 2, not_ours_then_main_ends(wire.multifd_init(2)),
     "multifd: received channel id 2 is greater than number of channels 2")
case("multifd_duplicate_id", True, 2,
     lambda p: ignored_then_main_ends(
         p, good_start, channels=(1,),
         before=lambda p: [connect(p, wire.multifd_init(0), close=False),
                           connect(p, wire.multifd_init(0))][:1]),
     "multifd: received id '0' already setup'")
case("multifd_too_many_pages", True, 2,
     lambda p: multifd_then(p, 2, wire.multifd_packet([0], 1, pages_alloc=129)),
     "multifd: received packet with 129 pages, expected 128")
case("multifd_offset_out_of_range", True, 2,
     lambda p: multifd_then(p, 2, wire.multifd_packet([SIZE], 1) + b"\1" * 4096),
     "multifd: offset too long 16777216")
case("multifd_unaligned_offset", True, 2,
     lambda p: multifd_then(p, 2, wire.multifd_packet([100], 1) + b"\1" * 4096),
     "multifd: unaligned page offset 0x64")
case("multifd_unknown_block", True, 2,
     lambda p: multifd_then(p, 2, wire.multifd_packet([0], 1, block="nosuch")),
     "multifd: unknown ram block nosuch")
case("multifd_truncated_packet", True, 2,
     lambda p: multifd_then(p, 2, wire.multifd_packet([0, 4096], 2) + b"\1" * 5000,
                            close_channels=True),
     "unexpected end of stream in the middle of a packet")
case("multifd_bad_magic_packet", True, 2,
     lambda p: multifd_then(p, 2, b"\0" * 1344),
     "multifd: received packet magic 0")
case("multifd_random_bytes", True, 2,
     lambda p: multifd_then(p, 2, random.Random(2).randbytes(4000)),
     "multifd: received packet magic")
case("more_channels_than_configured", True, 2,
     lambda p: ignored_then_main_ends(p, good_start, channels=(0, 1),
                                      extra=lambda p: connect(p, wire.multifd_init(2))),
     "(a connection was ignored: a multifd channel came past the 2 configured here")


def packets_lost_on_an_ignored_channel(p):
    """A stream that completes but for packet 1, sent on a third channel the
    destination (2 channels) ignored: the numbers tell."""
    m = connect(p, good_start, close=False)
    chans = [connect(p, wire.multifd_init(i), close=False) for i in range(2)]
    wait_status(H.dst, ("active",), timeout=60)
    lost = connect(p, wire.multifd_init(2) + wire.multifd_packet([4096], 1, num=1) + b"\2" * 4096)
    wait_until("the third channel to be ignored",
               lambda: "Extra incoming migration connection; ignoring" in H.dst.log_text())
    chans[0].sendall(wire.multifd_packet([0], 1, num=0) + b"\1" * 4096 +
                     wire.multifd_packet([], 0, flags=wire.MULTIFD_SYNC, num=2))
    chans[1].sendall(wire.multifd_packet([], 0, flags=wire.MULTIFD_SYNC, num=3))
    m.sendall(wire.part() + wire.flag(wire.FLUSH) + wire.flag(wire.EOS) + wire.footer() +
              wire.end() + wire.flag(wire.EOS) + wire.footer() + b"\x00")
    m.close()  # as a source does once it is done
    return chans + [lost]


case("packets_lost_on_an_ignored_channel", True, 2, packets_lost_on_an_ignored_channel,
     "multifd: 3 packets arrived, numbered up to 3")
case("flush_waits_for_a_closed_channel", True, 2,
     lambda p: multifd_then(p, 2, b"", wire.part() + wire.flag(wire.FLUSH), close_channels=True),
     "closed before sync point")


@cleanup
def remove_shared():
    global H
    if H:
        H.close()
        H = None


if __name__ == "__main__":
    main()
