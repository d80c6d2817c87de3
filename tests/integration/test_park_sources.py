#!/usr/bin/env python3
"""A parking destination against every source it may meet, hostile ones
included: it never loses a VM, never aborts, never grows with the stream.
Fake sources speak the wire format by hand (wire.py); QEMU 10 `-M none`
guests park in a second.
  - block names and machine types that are not UTF-8 (or 256 bytes long)
    park, and a resume sends back the very bytes that came;
  - a source with a return path (a fake one, QEMU 10 with `return-path`,
    and with `postcopy-ram` that never switches) gets its SHUT(0) once the
    park is durable, though it never closes the stream first;
  - a directory on hugetlbfs is refused at start; a park that cannot be
    made durable answers SHUT(1), and a QEMU 10 source fails, never
    `completed`;
  - an unterminated dirty-bitmap section and an endless device state fail
    the park at their caps, and a postcopy package holds only what came of
    it: the daemon's memory is bounded while they fill;
  - a stream with no RAM block list is refused on every path (postcopy's
    package, precopy with an empty ram section), and the daemon parks again."""
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile

import wire
from itest import test, main, check, skip, cleanup
from fixtures import resume_parked_to_qemu
from runner import (Peer, migrate, wait_status, start_incoming, unique_name, make_image,
                    files_equal, proc_status, stop_all, QMIGD)
import runner  # noqa: E402
from backing import backing_dir, Unavailable
from waiting import DEADLINE, tcp_sockets, wait_until

MiB = 1 << 20
PAGE = wire.PAGE
SIZE = 32 * MiB
WORK = tempfile.mkdtemp(prefix="qmigd-parksrc-", dir="/dev/shm")
SRC_IMG = os.path.join(WORK, "guest.ram")
make_image(SRC_IMG, SIZE, "mixed", seed=11)
RP_SHUT = 1


def new_dir(tag):
    return tempfile.mkdtemp(prefix=tag + "-", dir=WORK)


def parking_dest(tag, d, caps=()):
    dst = Peer("qmigd", "dest", [], tag, extra=["--ram-dir", d])
    if caps:
        dst.qmp.cmd("migrate-set-capabilities",
                    capabilities=[{"capability": c, "state": True} for c in caps])
    return dst


class FakeSource:
    """One connection to a parking destination: sends a stream by hand and
    reads what comes back on the return path."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))

    def send(self, data):
        self.sock.sendall(data)

    def shut(self, timeout=DEADLINE):
        """The SHUT value the destination sends back, or None if the
        connection ends without one (or none comes within `timeout`, a
        hang guard: every caller expects one)."""
        self.sock.settimeout(timeout)
        buf = b""
        try:
            while True:
                while len(buf) >= 4:
                    typ, n = struct.unpack(">HH", buf[:4])
                    if len(buf) < 4 + n:
                        break
                    if typ == RP_SHUT:
                        return struct.unpack(">I", buf[4:8])[0]
                    buf = buf[4 + n:]
                chunk = self.sock.recv(65536)
                if not chunk:
                    return None
                buf += chunk
        except (socket.timeout, OSError):
            return None

    def close(self):
        self.sock.close()


def park_stream(machine="pc-q35-10.0", blocks=(("pc.ram", 2 * PAGE),), rp=False,
                device_state=None):
    """A whole stream: every block's first page written, then device state."""
    s = wire.header() + wire.config(machine)
    if rp:
        s += wire.command(wire.OPEN_RETURN_PATH)
    s += wire.start() + wire.mem_size(list(blocks)) + wire.flag(wire.EOS) + wire.footer()
    s += wire.part()
    for i, (name, _) in enumerate(blocks):
        s += wire.page(0, bytes([0x41 + i]) * PAGE, block=name)
    s += wire.flag(wire.EOS) + wire.footer()
    s += wire.end() + wire.flag(wire.EOS) + wire.footer()
    return s + (device_state if device_state is not None else wire.device_state())


def fake_park(tag, d, stream, rp=False, caps=(), want="completed", inspect=None):
    """Feeds `stream` to a parking destination; returns (query-migrate, SHUT
    value or None). Without a return path the source closes after it.
    `inspect(dst)` runs at the end, before the destination quits."""
    dst = parking_dest(tag, d, caps)
    try:
        src = FakeSource(start_incoming(dst))
        try:
            src.send(stream)
            if rp:
                value = src.shut()
            else:
                src.sock.shutdown(socket.SHUT_WR)
                value = None
            info = wait_status(dst, (want,), fail_on=())
            if inspect:
                inspect(dst)
        finally:
            src.close()
        return info, value
    finally:
        dst.stop()


def qemu_guest(tag, path=SRC_IMG, role="source"):
    return Peer("qemu", role, [("mem", path, SIZE)], tag)


def resume_to_qemu(directory, tag):
    resume_parked_to_qemu(directory, tag, SRC_IMG, WORK)


def record(d):
    with open(os.path.join(d, "vm.json")) as f:
        return json.load(f)


def names(rec):
    """The record's machine type and block names as bytes, either form."""
    def get(j, key):
        return bytes.fromhex(j[key + "-hex"]) if key + "-hex" in j else j[key].encode()
    return get(rec, "machine-type"), [get(b, "idstr") for b in rec["blocks"]]


@test
def test_names_that_are_not_utf8_park_and_resume_byte_identical():
    cases = [
        (b"pc-\xc3(", [(b"pc.ram\xff\xfe", 2 * PAGE), ("r\u00e9m\x01", PAGE)]),
        (b"m" * 256, [(b"\x80" * 255, PAGE)]),
    ]
    for n, (machine, blocks) in enumerate(cases):
        d, relay = new_dir(f"names{n}"), new_dir(f"relay{n}")
        hmp = {}
        info, _ = fake_park(f"names{n}", d, park_stream(machine, blocks), inspect=lambda dst:
                            hmp.update(text=dst.qmp.cmd("human-monitor-command",
                                                        **{"command-line": "info migrate"})))
        check(info["status"] == "completed" and "parked" in info, info)
        check("parked block:" in hmp["text"], hmp)
        want = (machine, [b if isinstance(b, bytes) else b.encode() for b, _ in blocks])
        check(names(record(d)) == want, (record(d), want))
        # The resume's stream carries the names back: parked again by a
        # second destination, they are the same bytes.
        src = Peer("qmigd", "source", [], f"names{n}-src", extra=["--ram-dir", d])
        dst = parking_dest(f"relay{n}", relay)
        try:
            si, di, _ = migrate(src, dst, False, 1, "legacy")
            check(si["status"] == "completed" and di["status"] == "completed", (si, di))
        finally:
            stop_all(src, dst)
        check(names(record(relay)) == want, (record(relay), want))
        for i in range(len(blocks)):
            img = [x for x in sorted(os.listdir(d)) if x.startswith(f"{i:02}-")][0]
            check(files_equal(os.path.join(d, img), os.path.join(relay, img)), img)


@test
def test_fake_source_with_a_return_path_gets_its_shut():
    d = new_dir("rp-fake")
    info, value = fake_park("rp-fake", d, park_stream(rp=True), rp=True)
    check(value == 0, f"SHUT({value}) instead of SHUT(0): the park waited for the stream to end")
    check(info["status"] == "completed", info)
    with open(os.path.join(d, "device-state.bin"), "rb") as f:
        check(f.read() == wire.device_state(), "device-state.bin differs from what was sent")


def qemu_park(tag, d, caps, want="completed"):
    """Parks a QEMU -M none guest with `caps` on both sides; returns both
    sides' query-migrate once each reached its end."""
    guest = qemu_guest(tag + "-guest")
    dst = parking_dest(tag + "-park", d)
    try:
        for p in (guest, dst):
            p.qmp.cmd("migrate-set-capabilities",
                      capabilities=[{"capability": c, "state": True} for c in caps])
        port = start_incoming(dst)
        guest.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        ends = ("completed", "failed")
        si = wait_status(guest, ends, fail_on=())
        di = wait_status(dst, ends, fail_on=())
        return si, di
    finally:
        stop_all(dst, guest)


@test
def test_sources_with_a_return_path_park():
    """QEMU 10 with return-path, and with postcopy-ram that never switches;
    a qmigd source (its device state and QEMU's description of it)."""
    for caps in (["return-path"], ["postcopy-ram"]):
        d = new_dir("rp-qemu")
        si, di = qemu_park("rp-" + caps[0], d, caps)
        check(si["status"] == "completed" and di["status"] == "completed", (caps, si, di))
        resume_to_qemu(d, "rp-resume")
    d = new_dir("rp-qmigd")
    src = Peer("qmigd", "source", [("mem", SRC_IMG, SIZE)], "rp-qmigd-src")
    dst = parking_dest("rp-qmigd-park", d, ["return-path"])
    try:
        src.qmp.cmd("migrate-set-capabilities",
                    capabilities=[{"capability": "return-path", "state": True}])
        port = start_incoming(dst)
        src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        si = wait_status(src, ("completed",))
        wait_status(dst, ("completed",))
        check("return path: the destination says it is done" in src.log_text(), si)
    finally:
        stop_all(src, dst)
    resume_to_qemu(d, "rp-qmigd-resume")


@test
def test_one_destination_parks_one_vm_after_another():
    """A parking destination, its first VM moved out of DIR once parked,
    parks a second one into DIR: both resume byte for byte (the second park
    neither took the first VM's blocks for its own nor removed them)."""
    d = new_dir("again")
    moved = d + "-first"
    second = os.path.join(WORK, unique_name("again-src2") + ".ram")
    make_image(second, SIZE, "random")
    dst = parking_dest("again-park", d)
    try:
        for img, tag in ((SRC_IMG, "again-src1"), (second, "again-src2")):
            src = Peer("qmigd", "source", [("mem", img, SIZE)], tag)
            try:
                port = start_incoming(dst)
                src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
                si = wait_status(src, ("completed", "failed"), fail_on=())
                di = wait_status(dst, ("completed", "failed"), fail_on=())
                check(si["status"] == "completed" and di["status"] == "completed", (tag, si, di))
            finally:
                src.stop()
            if img == SRC_IMG:
                os.rename(d, moved)
                os.mkdir(d)
    finally:
        dst.stop()
    try:
        resume_parked_to_qemu(moved, "again-resume1", SRC_IMG, WORK)
        resume_parked_to_qemu(d, "again-resume2", second, WORK)
    finally:
        runner.remove(second)
        shutil.rmtree(moved, ignore_errors=True)


@test
def test_a_cancel_at_the_end_of_a_park_leaves_all_or_nothing():
    """migrate_cancel sent as the whole stream has arrived (the images
    syncing, the record being written): the park ends whole (completed,
    vm.json, SHUT(0), resumable) or not at all (cancelled, no record, no
    image, SHUT(1)), whichever came first; never a record of a VM whose
    images the cancel removed. On ext4 (/var/tmp), where syncs take time."""
    seen = set()
    for n in range(8):
        d = tempfile.mkdtemp(prefix=f"cancel-end{n}-", dir="/var/tmp")
        dst = parking_dest(f"cancel-end{n}", d)
        try:
            port = start_incoming(dst)
            src = FakeSource(port)
            try:
                src.send(park_stream(rp=True, blocks=(("pc.ram", 64 * MiB),)))
                # The destination has read all of it (its socket's receive
                # queue is empty): the park is flushing, syncing, committing.
                mine = src.sock.getsockname()[1]
                wait_until("the destination to read the whole stream", lambda: any(
                    t.lport == port and t.rport == mine and t.rx_queue == 0
                    for t in tcp_sockets()))
                dst.qmp.cmd("migrate_cancel")
                value = src.shut()
            finally:
                src.close()
            info = wait_status(dst, ("completed", "cancelled", "failed"), fail_on=())
        finally:
            dst.stop()
        try:
            files = sorted(os.listdir(d))
            seen.add(info["status"])
            if info["status"] == "completed":
                check(value == 0 and "vm.json" in files, (info, value, files))
                record = json.load(open(os.path.join(d, "vm.json")))
                check([b["idstr"] for b in record["blocks"]] == ["pc.ram"], record)
            else:
                check(value == 1 and "vm.json" not in files
                      and not any(f.endswith(".img") for f in files), (info, value, files))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    print(f"  outcomes: {sorted(seen)}")


@test
def test_hugetlbfs_directory_refused_at_start():
    try:
        with backing_dir("hugetlbfs") as hd:
            qmp = os.path.join("/tmp", unique_name("huge") + ".qmp")
            try:
                # A daemon that started would run on: the timeout (a hang
                # guard) is reached only by that defect.
                r = subprocess.run([QMIGD, "dest", "--ram-dir", hd, "--qmp", qmp],
                                   capture_output=True, text=True, timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                check(False, "qmigd dest --ram-dir on hugetlbfs started: the park would fail "
                             "only after the whole transfer")
            said = r.stdout + r.stderr
            check(r.returncode == 1 and "cannot hold a parked VM" in said, said[-600:])
            check(os.listdir(hd) == [], os.listdir(hd))
    except Unavailable as why:
        skip(f"hugetlbfs unavailable here: {why}", machine=True)


def undurable_dir(tag):
    """A directory where the park's device state cannot be written (a
    directory planted at its temporary name): the park fails at its end."""
    d = new_dir(tag)
    os.mkdir(os.path.join(d, "device-state.bin.tmp"))
    return d


@test
def test_park_that_cannot_be_made_durable_is_never_completed():
    d = undurable_dir("undurable-fake")
    info, value = fake_park("undurable-fake", d, park_stream(rp=True), rp=True, want="failed")
    check(value == 1, f"SHUT({value}) for a park that failed")
    check("device-state.bin.tmp" in info.get("error-desc", ""), info)
    check(not os.path.exists(os.path.join(d, "vm.json")), os.listdir(d))
    d = undurable_dir("undurable-qemu")
    si, di = qemu_park("undurable-qemu", d, ["return-path"])
    check(si["status"] == "failed" and di["status"] == "failed", (si, di))


def flood(tag, opening, chunk, total, caps=()):
    """Sends `opening`, then `chunk` until `total` bytes went or the
    destination closed, then closes; returns (query-migrate once failed,
    the daemon's peak RSS growth, bytes sent)."""
    d = new_dir(tag)
    dst = parking_dest(tag, d, caps)
    try:
        base = int(proc_status(dst.proc.pid)["VmRSS"].split()[0]) << 10
        src = FakeSource(start_incoming(dst))
        sent = 0
        try:
            src.send(opening)
            while sent < total:
                src.send(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the destination gave up and closed: what it should do
        finally:
            src.close()
        info = wait_status(dst, ("failed",), fail_on=("completed",))
        peak = int(proc_status(dst.proc.pid)["VmHWM"].split()[0]) << 10
        print(f"  {tag}: sent {sent >> 20} MiB; peak RSS {peak >> 20} MiB over a start of "
              f"{base >> 20} MiB")
    finally:
        dst.stop()
    check(os.listdir(d) == [], os.listdir(d))
    return info, peak - base, sent


RAM_START = (wire.start() + wire.mem_size([("mem", PAGE)]) + wire.flag(wire.EOS)
             + wire.footer())


@test
def test_buffers_filled_from_the_wire_are_bounded_while_they_fill():
    """An unterminated dirty-bitmap section and a device state that never
    ends fail at their 64 MiB caps, the daemon grown by about that; a
    postcopy package announced at 60 MiB holds only what came of it."""
    opening = wire.header() + wire.config() + RAM_START
    # BITS records of 10 KiB (QEMU's largest chunk), never EOS.
    bits = (bytes([0x40]) + wire.be64(0) + wire.be32(1) + wire.be64(10240) + bytes(10240)) * 100
    info, grown, _ = flood("bitmap", opening + wire.start("dirty-bitmap", sid=2, version=1),
                           bits, 256 * MiB)
    check("dirty-bitmap section: more than" in info.get("error-desc", ""), info)
    check(grown <= 96 * MiB or runner.SANITIZED, f"the daemon grew by {grown >> 20} MiB")
    device = b"\x04" + wire.be32(9) + wire.cstr8("dev0") + wire.be32(0) + wire.be32(1)
    info, grown, _ = flood("device", opening + wire.end() + wire.flag(wire.EOS) + wire.footer()
                           + device, b"\x5a" * MiB, 256 * MiB)
    check("more than 67108864 bytes" in info.get("error-desc", ""), info)
    check(grown <= 96 * MiB or runner.SANITIZED, f"the daemon grew by {grown >> 20} MiB")
    advise = wire.command(wire.POSTCOPY_ADVISE, wire.be64(PAGE) + wire.be64(PAGE))
    package = wire.command(wire.PACKAGED, wire.be32(60 * MiB))
    info, grown, sent = flood("package", wire.header() + wire.config() + advise + RAM_START
                              + package, b"\x5a" * MiB, 8 * MiB, caps=["postcopy-ram"])
    check("CMD_PACKAGED" in info.get("error-desc", ""), info)
    check(grown <= 8 * MiB + 16 * MiB or runner.SANITIZED, f"{sent >> 20} MiB of a package grew the daemon by "
                                       f"{grown >> 20} MiB")


def postcopy_no_ram_stream():
    """Postcopy advised, the device state in its package, and no RAM."""
    sections, _ = wire.device_sections()
    package = (wire.command(wire.POSTCOPY_LISTEN) + sections
               + wire.command(wire.POSTCOPY_RUN))
    return (wire.header() + wire.config("pc-q35-10.0") + wire.command(wire.OPEN_RETURN_PATH)
            + wire.command(wire.POSTCOPY_ADVISE, wire.be64(PAGE) + wire.be64(PAGE))
            + wire.command(wire.PACKAGED, wire.be32(len(package))) + package + b"\x00")


def empty_ram_stream():
    """Precopy with a ram section that lists no block."""
    return (wire.header() + wire.config("pc-q35-10.0") + wire.command(wire.OPEN_RETURN_PATH)
            + wire.start() + wire.flag(wire.EOS) + wire.footer()
            + wire.end() + wire.flag(wire.EOS) + wire.footer() + wire.device_state())


@test
def test_stream_without_a_ram_block_list_refused_on_every_path():
    for tag, stream, caps in (("postcopy", postcopy_no_ram_stream(), ["postcopy-ram"]),
                              ("precopy", empty_ram_stream(), [])):
        d = new_dir("noram-" + tag)
        info, value = fake_park("noram-" + tag, d, stream, rp=True, caps=caps, want="failed")
        check("no RAM block list" in info.get("error-desc", ""), (tag, info))
        check(value == 1, f"{tag}: SHUT({value})")
        check(not os.path.exists(os.path.join(d, "vm.json")), (tag, os.listdir(d)))
        # The directory parks a whole VM afterwards.
        info, _ = fake_park("noram-again", d, park_stream())
        check(info["status"] == "completed", info)


@cleanup
def remove_shared():
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
