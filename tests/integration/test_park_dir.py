#!/usr/bin/env python3
"""A parked VM's directory is input, and what a park reports `completed`
is durable. A QEMU 10 `-M none` guest (RAM only, its few device sections)
is parked in seconds, so these run in the sanitizer builds too:
  - every file qmigd reads from --ram-dir (vm.json of wrong types, a huge,
    FIFO or /dev/zero device-state.bin, symbolic links) gets a clear error,
    no crash and no hang; links planted where a park writes are not followed;
  - the parked files are private (0600); a 255-byte block name parks;
  - a resume writes nothing: from a read-only mount, two at once;
  - a park syncs its images and device state, publishes vm.json by rename
    and syncs the directory before `completed` (strace), a file: save syncs
    before `completed`; kill -9 at random points of a park (steered into
    it by what the park has taken) leaves no vm.json or a whole VM, and
    the directory parks again."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile

from itest import test, main, check, skip, cleanup
from fixtures import resume_parked_to_qemu
from qmp import QMPError
from runner import (Peer, migrate, wait_status, start_incoming, unique_name, make_image,
                    files_equal, remove, stop_all, QMIGD, log_file)
from waiting import wait_until

MiB = 1 << 20
SIZE = 64 * MiB
WORK = tempfile.mkdtemp(prefix="qmigd-parkdir-", dir="/dev/shm")
SRC_IMG = os.path.join(WORK, "guest.ram")
make_image(SRC_IMG, SIZE, "mixed", seed=7)


def qemu_guest(tag, name="mem", path=SRC_IMG, role="source"):
    return Peer("qemu", role, [(name, path, SIZE)], tag)


def park(directory, tag, name="mem", path=SRC_IMG, wrap=None):
    """Parks a QEMU -M none guest in `directory`; returns the destination's
    query-migrate."""
    guest = qemu_guest(tag + "-guest", name, path)
    dst = Peer("qmigd", "dest", [], tag + "-park", extra=["--ram-dir", directory], wrap=wrap)
    try:
        si, di, _ = migrate(guest, dst, False, 1, "legacy", events=True)
        check(si["status"] == "completed" and di["status"] == "completed", (si, di))
        return di
    finally:
        stop_all(dst, guest)


def new_dir(tag):
    return tempfile.mkdtemp(prefix=tag + "-", dir=WORK)


_parked = {}


def parked():
    if "dir" not in _parked:
        d = new_dir("vm")
        park(d, "first")
        _parked["dir"] = d
    return _parked["dir"]


def copy_parked(tag):
    c = new_dir(tag)
    for name in os.listdir(parked()):
        shutil.copy(os.path.join(parked(), name), c)
    return c


def snapshot(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        st = os.lstat(os.path.join(directory, name))
        out[name] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def source_start(directory, want, timeout=60):
    """qmigd source --ram-dir must refuse `directory` with `want` in its
    words (a FIFO or /dev/zero must not hang it: `timeout` guards that)."""
    qmp = os.path.join("/tmp", unique_name("pd") + ".qmp")
    try:
        r = subprocess.run([QMIGD, "source", "--ram-dir", directory, "--qmp", qmp],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        check(False, f"qmigd source --ram-dir hung on {directory} (wanted {want!r})")
    said = r.stdout + r.stderr
    check(r.returncode == 1 and want in said, (want, r.returncode, said[-600:]))
    check("Sanitizer" not in said and "terminate called" not in said, said[-2000:])


def edit_record(tag, fn):
    d = copy_parked(tag)
    with open(os.path.join(d, "vm.json")) as f:
        rec = json.load(f)
    fn(rec)
    with open(os.path.join(d, "vm.json"), "w") as f:
        json.dump(rec, f)
    return d


def resume_to_qemu(directory, tag):
    resume_parked_to_qemu(directory, tag, SRC_IMG, WORK)


@test
def test_parked_files_are_private():
    d = parked()
    names = sorted(os.listdir(d))
    check(names == ["00-mem.img", "device-state.bin", "vm.json"], names)
    for name in names:
        mode = os.stat(os.path.join(d, name)).st_mode & 0o777
        check(mode == 0o600, f"{name} has mode {mode:o}")
    check(files_equal(SRC_IMG, os.path.join(d, "00-mem.img")), "parked RAM differs")


@test
def test_record_of_wrong_types_refused():
    cases = [
        ("format", lambda r: r.update(format=5), "is not a parked VM record"),
        ("version", lambda r: r.update(version="1"), "record version \"1\" is not supported"),
        # Types as QMP arguments are checked (monitor/qapi_visit), in the same words.
        ("machine", lambda r: r.update({"machine-type": 5}),
         "Invalid parameter type for 'machine-type', expected: string"),
        ("machine-both", lambda r: r.update({"machine-type-hex": "41"}),
         "'machine-type' must be a string"),
        ("section", lambda r: r.update({"ram-section-id": -1}),
         "Parameter 'ram-section-id' expects uint32_t"),
        ("section-big", lambda r: r.update({"ram-section-id": 1 << 40}),
         "Parameter 'ram-section-id' expects uint32_t"),
        ("blocks", lambda r: r.update(blocks="x"),
         "Invalid parameter type for 'blocks', expected: array"),
        ("block", lambda r: r.update(blocks=[5]),
         "Invalid parameter type for 'blocks[0]', expected: object"),
        ("idstr", lambda r: r["blocks"][0].update(idstr=5),
         "Invalid parameter type for 'blocks[0].idstr', expected: string"),
        ("no-idstr", lambda r: r["blocks"][0].pop("idstr"), "each block needs 'idstr'"),
        ("size", lambda r: r["blocks"][0].update(size="1"),
         "Parameter 'blocks[0].size' expects uint64"),
        ("odd-size", lambda r: r["blocks"][0].update(size=4095), "whole pages"),
        ("twice", lambda r: r["blocks"].append(dict(r["blocks"][0])), "two blocks have one idstr"),
        ("uuid", lambda r: r.update(uuid=5), "Invalid parameter type for 'uuid', expected: string"),
        ("uuid-text", lambda r: r.update(uuid="x"), "'uuid' must be a UUID string"),
        ("ds-bytes", lambda r: r.update({"device-state-bytes": "x"}),
         "Parameter 'device-state-bytes' expects uint64"),
        ("unknown", lambda r: r.update(extra=1), "Parameter 'extra' is unexpected"),
        ("ds-other", lambda r: r.update({"device-state-bytes": 7}), "the record says 7"),
    ]
    for tag, fn, want in cases:
        source_start(edit_record(tag, fn), want)
    bad = copy_parked("not-json")
    with open(os.path.join(bad, "vm.json"), "w") as f:
        f.write('{"format": "qmigd-parked-vm", ')
    source_start(bad, "is not a parked VM record")
    # A repeated key is refused, not read as its last value.
    dup = copy_parked("dup-key")
    path = os.path.join(dup, "vm.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write('{"format": "x", ' + text.lstrip()[1:])
    source_start(dup, "JSON parse error, duplicate key")


@test
def test_side_files_that_are_not_files_refused():
    big = copy_parked("huge-ds")
    os.truncate(os.path.join(big, "device-state.bin"), 100 << 30)  # sparse: 100 GiB
    source_start(big, "is larger than")
    fifo = copy_parked("fifo-ds")
    os.unlink(os.path.join(fifo, "device-state.bin"))
    os.mkfifo(os.path.join(fifo, "device-state.bin"))
    source_start(fifo, "is not a regular file")
    zero = copy_parked("zero-ds")
    os.unlink(os.path.join(zero, "device-state.bin"))
    os.symlink("/dev/zero", os.path.join(zero, "device-state.bin"))
    source_start(zero, "is a symbolic link")
    rec = copy_parked("link-rec")
    os.rename(os.path.join(rec, "vm.json"), os.path.join(rec, "real.json"))
    os.symlink("real.json", os.path.join(rec, "vm.json"))
    source_start(rec, "is a symbolic link")
    img = copy_parked("link-img")
    os.rename(os.path.join(img, "00-mem.img"), os.path.join(img, "elsewhere"))
    os.symlink("elsewhere", os.path.join(img, "00-mem.img"))
    source_start(img, "is not a regular file")
    fimg = copy_parked("fifo-img")
    os.unlink(os.path.join(fimg, "00-mem.img"))
    os.mkfifo(os.path.join(fimg, "00-mem.img"))
    source_start(fimg, "is not a regular file")


@test
def test_links_planted_where_a_park_writes_are_not_followed():
    d = new_dir("planted")
    victims = {}
    for name in ("00-mem.img", "device-state.bin.tmp", "vm.json.tmp", "device-state.bin"):
        victim = os.path.join(WORK, unique_name("victim"))
        with open(victim, "wb") as f:
            f.write(b"precious")
        os.symlink(victim, os.path.join(d, name))
        victims[name] = victim
    park(d, "planted")
    for name, victim in victims.items():
        with open(victim, "rb") as f:
            check(f.read() == b"precious", f"the park wrote through the link {name}")
    check(not any(os.path.islink(os.path.join(d, n)) for n in os.listdir(d)), os.listdir(d))
    check(not any(n.endswith(".tmp") for n in os.listdir(d)), os.listdir(d))
    resume_to_qemu(d, "planted")


@test
def test_longest_block_name_parks():
    name = "m" + "x" * 254  # QEMU takes an idstr of up to 255 bytes
    d = new_dir("long")
    info = park(d, "long", name=name)
    check(info["parked"]["blocks"][0]["id"] == name, info["parked"])
    files = [n for n in os.listdir(d) if n.endswith(".img")]
    check(len(files) == 1 and len(files[0]) <= 255, files)
    src = Peer("qmigd", "source", [], "long-src", extra=["--ram-dir", d])
    img = os.path.join(WORK, unique_name("long") + ".ram")
    dst = qemu_guest("long-dst", name, img, role="dest")
    try:
        migrate(src, dst, False, 1, "legacy")
        check(files_equal(SRC_IMG, img), "RAM differs after a resume with a long block name")
    finally:
        try:
            stop_all(src, dst)
        finally:
            remove(img)


@test
def test_resume_from_a_read_only_directory_twice_at_once():
    d = copy_parked("ro")
    ro = new_dir("ro-mount")
    if subprocess.run(["mount", "--bind", d, ro]).returncode != 0:
        skip("cannot bind-mount (not root?)", machine=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", ro], check=True)
        before = snapshot(ro)
        pairs = []
        try:
            for i in range(2):
                img = os.path.join(WORK, unique_name(f"ro{i}") + ".ram")
                src = Peer("qmigd", "source", [], f"ro{i}-src", extra=["--ram-dir", ro])
                dst = qemu_guest(f"ro{i}-dst", path=img, role="dest")
                pairs.append((src, dst, img))
            for src, dst, _ in pairs:
                src.set_migration(False)
                dst.set_migration(False)
                port = start_incoming(dst)
                src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            for src, dst, img in pairs:
                wait_status(src, ("completed",), 60)
                wait_status(dst, ("completed",), 60)
                check(files_equal(SRC_IMG, img), "a resume from the read-only copy differs")
        finally:
            try:
                stop_all(*(p for src, dst, _ in pairs for p in (src, dst)))
            finally:
                remove(*(img for _, _, img in pairs))
        check(snapshot(ro) == before, "resuming changed the directory")
    finally:
        subprocess.run(["umount", ro])


STRACE = shutil.which("strace")


def traced(tag):
    if not STRACE:
        skip("strace is not installed")
    out = log_file(unique_name(tag), ".strace")
    # LeakSanitizer cannot run under ptrace: an ASan build leaves it off here.
    asan = os.environ.get("ASAN_OPTIONS", "")
    return out, ["env", f"ASAN_OPTIONS={asan + ':' if asan else ''}detect_leaks=0",
                 STRACE, "-f", "-y", "-s", "120", "-o", out,
                 "-e", "trace=fsync,fdatasync,rename,renameat,renameat2,write"]


def joined_calls(trace):
    """strace's lines with each call strace split around another thread's
    ("<unfinished ...>", then "<... NAME resumed>") joined back into one,
    placed where the call returned."""
    pending = {}
    with open(trace) as f:
        for line in f:
            pid, _, rest = line.rstrip("\n").partition(" ")
            if rest.endswith("<unfinished ...>"):
                pending[pid] = rest[:-len("<unfinished ...>")]
                continue
            m = re.match(r"\s*<\.\.\. \w+ resumed>(.*)", rest)
            if m and pid in pending:
                rest = pending.pop(pid) + m.group(1)
            yield rest


def events_in(trace):
    """(kind, detail) in the order the daemon's calls returned."""
    out = []
    for call in joined_calls(trace):
        m = re.search(r"(?:fsync|fdatasync)\(\d+<([^>]*)>.*\)\s+= 0", call)
        if m:
            out.append(("sync", m.group(1)))
            continue
        m = re.search(r"rename(?:at2?)?\(.*\"([^\"]+)\", .*\"([^\"]+)\".*\)\s+= 0", call)
        if m:
            out.append(("rename", os.path.basename(m.group(2))))
            continue
        if re.search(r"migration:? completed", call):
            out.append(("completed", ""))
    return out


@test
def test_park_is_durable_before_completed():
    d = new_dir("durable")
    trace, wrap = traced("park")
    park(d, "durable", wrap=wrap)
    ev = events_in(trace)
    def first(kind, detail):
        i = next((i for i, e in enumerate(ev) if e[0] == kind and e[1].endswith(detail)), None)
        check(i is not None, f"no {kind} of {detail} in {ev}")
        return i
    img_sync = first("sync", "/00-mem.img")
    ds_sync = first("sync", "/device-state.bin.tmp")
    ds_rename = first("rename", "device-state.bin")
    rec_sync = first("sync", "/vm.json.tmp")
    rec_rename = first("rename", "vm.json")
    dir_syncs = [i for i, e in enumerate(ev) if e == ("sync", d)]
    done = first("completed", "")
    check(img_sync < ds_rename and ds_sync < ds_rename, ev)
    check(any(ds_rename < i < rec_rename for i in dir_syncs), f"no directory sync before vm.json: {ev}")
    check(rec_sync < rec_rename, ev)
    check(any(rec_rename < i < done for i in dir_syncs), f"no directory sync after vm.json: {ev}")


@test
def test_file_save_is_durable_before_completed():
    for mapped, direct in ((False, False), (True, False), (True, True)):
        path = os.path.join("/var/tmp", unique_name("save") + ".mig")
        trace, wrap = traced("save")
        img = os.path.join(WORK, unique_name("save") + ".ram")
        shutil.copyfile(SRC_IMG, img)
        src = Peer("qmigd", "source", [("mem", img, SIZE)], "save-src", wrap=wrap)
        try:
            src.set_migration(mapped, 2, mapped_ram=mapped,
                              extra_params={"direct-io": direct} if mapped else None)
            src.qmp.cmd("migrate", uri=f"file:{path}")
            wait_status(src, ("completed",), 60)
        finally:
            src.stop()
            remove(img, path)
        ev = events_in(trace)
        syncs = [i for i, e in enumerate(ev) if e[0] == "sync" and e[1] == path]
        done = [i for i, e in enumerate(ev) if e[0] == "completed"]
        check(syncs and done and syncs[0] < done[0], (mapped, direct, ev))


def nonzero_pages(path):
    zero = bytes(4096)
    with open(path, "rb") as f:
        return sum(page != zero for page in iter(lambda: f.read(4096), b""))


def image_written(d):
    """Bytes a park has written into its image so far: the pages it took
    (a zero page is a hole it leaves; tmpfs allocates what is written)."""
    try:
        return os.stat(os.path.join(d, "00-mem.img")).st_blocks * 512
    except FileNotFoundError:
        return 0


def kill_park_at(d, written):
    """Parks into `d` at 32 MiB/s (64 MiB of mixed content: about a second
    of stream, then the syncs and renames) and SIGKILLs the destination
    once it has written `written` bytes into its image, or with None once
    the source has sent the whole stream (the park is then at its end:
    syncing, renaming, or done). Returns the bytes written by the kill.
    (Its query-migrate's page counts are no help: on the main channel
    they are added up only at the end.)"""
    guest = qemu_guest("kill-guest")
    dst = Peer("qmigd", "dest", [], "kill-park", extra=["--ram-dir", d])
    try:
        guest.set_migration(False, max_bandwidth=32 * MiB)
        dst.set_migration(False)
        port = start_incoming(dst)
        guest.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        if written is None:
            wait_status(guest, ("completed",))
        else:
            def far_enough():
                info = dst.status()
                check(info.get("status") not in ("failed", "cancelled"), info)
                return image_written(d) >= written
            wait_until(f"the park to write {written >> 10} KiB of its image", far_enough,
                       seen=lambda: (image_written(d), dst.status()))
        had = image_written(d)
        dst.proc.send_signal(signal.SIGKILL)
        dst.proc.wait(60)
        return had
    finally:
        stop_all(dst, guest)


@test
def test_kill_9_at_random_points_of_a_park():
    """A park killed at any moment leaves no vm.json, or a whole parked VM
    (it resumes, byte for byte); either way the directory parks again.
    The kills are steered into the park: most once it has written a
    random share of its image (its record not written yet), some once the
    source has sent everything (the park's end). At least one must land
    mid-park, leaving no vm.json after pages were written; after each
    such kill the directory, as the kill left it, parks again and resumes
    byte for byte."""
    rng = random.Random(int(os.environ.get("QMIGD_KILL_SEED", "23")))
    total = nonzero_pages(SRC_IMG) * 4096  # what a whole park writes
    d = new_dir("killed")
    outcomes = {"mid": 0, "whole": 0}
    for _ in range(10):
        at = None if rng.random() < 0.2 else rng.randint(total // 50, total * 19 // 20)
        had = kill_park_at(d, at)
        if os.path.exists(os.path.join(d, "vm.json")):
            outcomes["whole"] += 1
            resume_to_qemu(d, "after-kill")
        else:
            # Killed mid-park: it had written into its image, no record.
            check(had > 0, f"a kill before the park wrote anything left {os.listdir(d)}")
            outcomes["mid"] += 1
            park(d, "re-park")
            resume_to_qemu(d, "re-parked")
        shutil.rmtree(d)
        os.mkdir(d)
    print(f"  10 parks killed: {outcomes['mid']} mid-park (no vm.json; parked again), "
          f"{outcomes['whole']} left a whole VM")
    check(outcomes["mid"] > 0, f"no kill landed mid-park: {outcomes}")


@test
def test_one_park_at_a_time_into_a_directory():
    """A directory is claimed by the park that listens for it first: a
    second destination's migrate-incoming into it is refused while the
    first runs (its source keeps its VM), the claim ends with its
    destination, and a destination started before a VM was parked there
    does not park over it later."""
    d = new_dir("claimed")
    first = Peer("qmigd", "dest", [], "claim-1", extra=["--ram-dir", d])
    second = Peer("qmigd", "dest", [], "claim-2", extra=["--ram-dir", d])
    late = Peer("qmigd", "dest", [], "claim-3", extra=["--ram-dir", d])
    guest = qemu_guest("claim-guest")
    try:
        start_incoming(first)
        try:
            start_incoming(second)
            check(False, "a second park into a claimed directory was taken")
        except QMPError as e:
            check("is being parked into by another migration" in str(e), str(e))
        first.stop()
        # The claim went with the first destination: the second parks.
        si, di, _ = migrate(guest, second, False, 1, "legacy", events=True)
        check(si["status"] == "completed" and di["status"] == "completed", (si, di))
        before = snapshot(d)
        try:
            start_incoming(late)
            check(False, "a park over a parked VM was taken")
        except QMPError as e:
            check("already holds a parked VM" in str(e), str(e))
        check(snapshot(d) == before, "the parked VM changed")
    finally:
        stop_all(guest, late, second, first)
    resume_to_qemu(d, "claimed")


@cleanup
def remove_shared():
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
