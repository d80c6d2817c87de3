#!/usr/bin/env python3
"""The migration parameter `mode` next to a live QEMU 10: cpr-reboot (the
guest stopped before the first page, the whole state sent stopped, the
stream an ordinary one that qmigd and QEMU 10 destinations load),
cpr-transfer (refused by qmigd in both roles, saying why; QEMU's own
checks in QEMU's words first), and QEMU's errors for each."""
import os

from itest import test, main, check
from fixtures import images, peers, MiB
from qmp import QMPError
from runner import Peer, Guest, wait_status, start_incoming, files_equal, stop_all, remove
from runner import unique_name

SIZE = 64 * MiB
MAIN = {"channel-type": "main",
        "addr": {"transport": "socket", "type": "inet", "host": "127.0.0.1", "port": "1"}}


def cpr_channel():
    return {"channel-type": "cpr",
            "addr": {"transport": "socket", "type": "unix",
                     "path": f"/tmp/{unique_name('cpr')}.sock"}}


def reply(peer, name, **args):
    r = peer.qmp.execute(name, args)
    return r.get("error", r.get("return"))


def mode_script(peer):
    """migrate's checks of `mode`, in QEMU's order; nothing starts."""
    caps = peer.qmp.cmd
    out = [reply(peer, "migrate-set-parameters", mode="bogus")]
    caps("migrate-set-parameters", mode="cpr-transfer")
    out.append(reply(peer, "migrate", uri="tcp:127.0.0.1:1"))
    out.append(reply(peer, "migrate", channels=[MAIN]))
    # A file main channel before the missing cpr channel.
    out.append(reply(peer, "migrate", uri="file:/tmp/qmigd-mode-never-written"))
    caps("migrate-set-capabilities", capabilities=[{"capability": "postcopy-ram", "state": True}])
    out.append(reply(peer, "migrate", uri="file:/tmp/qmigd-mode-never-written"))
    out.append(reply(peer, "migrate", channels=[MAIN, cpr_channel()]))
    caps("migrate-set-parameters", mode="cpr-reboot")
    out.append(reply(peer, "migrate", uri="tcp:127.0.0.1:1"))
    caps("migrate-set-capabilities", capabilities=[{"capability": "postcopy-ram", "state": False}])
    out.append(peer.qmp.cmd("query-migrate-parameters")["mode"])
    out.append(peer.qmp.cmd("query-migrate").get("status"))
    # A cpr channel that is not a unix socket, before anything qmigd refuses
    # (QEMU 10 then says `failed` in query-migrate, qmigd what it said
    # before: docs/differences.md).
    caps("migrate-set-parameters", mode="cpr-transfer")
    tcp_cpr = {"channel-type": "cpr",
               "addr": {"transport": "socket", "type": "inet", "host": "127.0.0.1", "port": "1"}}
    out.append(reply(peer, "migrate", channels=[MAIN, tcp_cpr]))
    return out


@test
def test_mode_errors_as_qemu():
    with images(SIZE, "zero") as imgs:
        ram = [(n, s, z) for n, s, _, z in imgs]
        qemu, qmigd = Peer("qemu", "source", ram, "mq"), Peer("qmigd", "source", ram, "mm")
        try:
            want, got = mode_script(qemu), mode_script(qmigd)
        finally:
            stop_all(qemu, qmigd)
        check(want == got, f"QEMU {want}\nqmigd {got}")
        print(f"  {len(want)} answers as QEMU 10's, e.g. {want[1]['desc']!r}")


@test
def test_cpr_transfer_refused_by_a_qmigd_source():
    with images(SIZE, "zero") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        s.qmp.cmd("migrate-set-parameters", mode="cpr-transfer")
        port = start_incoming(d)
        main_ch = dict(MAIN, addr=dict(MAIN["addr"], port=str(port)))
        try:
            s.qmp.cmd("migrate", channels=[main_ch, cpr_channel()])
            check(False, "cpr-transfer started")
        except QMPError as e:
            check(e.cls == "GenericError" and
                  e.desc.startswith("qmigd: migration mode cpr-transfer is not supported"), e)
            print(f"  {e.desc}")
        check(s.status() == {}, s.status())  # nothing started, as after any refusal
        s.qmp.cmd("migrate-set-parameters", mode="normal")
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(s, ("completed",), timeout=60)
        wait_status(d, ("completed",), timeout=60)


@test
def test_cpr_transfer_refused_by_a_qmigd_destination():
    """A QEMU 10 destination in cpr-transfer loads a stream without RAM and
    fails an ordinary one; a qmigd destination refuses at migrate-incoming."""
    with images(SIZE, "mixed") as imgs, peers("qmigd", "qemu", imgs) as (s, q):
        q.qmp.cmd("migrate-set-parameters", mode="cpr-transfer")
        q.qmp.cmd("migrate-incoming", uri="tcp:127.0.0.1:0", **{"exit-on-error": False})
        port = int(q.status()["socket-address"][0]["port"])
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        si = wait_status(s, ("failed",), timeout=30, fail_on=("completed",))
        qi = wait_status(q, ("failed",), timeout=30, fail_on=("completed",))
        print(f"  QEMU 10 destination in cpr-transfer, ordinary stream: {qi.get('error-desc')!r}")
        check(si["status"] == "failed", si)
    with images(SIZE, "zero") as imgs:
        d = Peer("qmigd", "dest", [(n, p, z) for n, _, p, z in imgs], "md")
        try:
            d.qmp.cmd("migrate-set-parameters", mode="cpr-transfer")
            try:
                d.qmp.cmd("migrate-incoming", uri="tcp:127.0.0.1:0")
                check(False, "cpr-transfer incoming started")
            except QMPError as e:
                check(e.desc.startswith("qmigd: migration mode cpr-transfer is not supported"),
                      e)
                print(f"  {e.desc}")
            check(d.status() == {}, d.status())
            d.qmp.cmd("migrate-set-parameters", mode="cpr-reboot")
            start_incoming(d)  # cpr-reboot's stream is an ordinary one
        finally:
            d.stop()


def cpr_reboot_save(src, path):
    src.qmp.cmd("migrate-set-parameters", mode="cpr-reboot", **{"max-bandwidth": 128 * MiB})
    src.qmp.cmd("migrate", uri=f"file:{path}")
    info = wait_status(src, ("completed",), timeout=60)
    check(src.qmp.cmd("query-status")["status"] == "postmigrate", "not postmigrate")
    ram = info["ram"]
    # The VM stopped before the first page: the whole state went stopped,
    # as the bytes sent while running and while stopped say. By the clock
    # the downtime is most of the active time; "most" is at least half, for
    # what a loaded host may stretch of the little that follows the
    # stopped phase (a 300 ms save here).
    check(ram["precopy-bytes"] < 64 << 10 and ram["downtime-bytes"] >= SIZE // 2, ram)
    active = info["total-time"] - info["setup-time"]
    check(info["downtime"] >= 0.5 * active, info)
    return info


def load_file(kind, image, path, size):
    d = Peer(kind, "dest", [("mem", image, size)], "ml")
    try:
        d.qmp.cmd("migrate-set-parameters", mode="cpr-reboot")
        d.qmp.cmd("migrate-incoming", uri=f"file:{path}")
        wait_status(d, ("completed",), timeout=60)
    finally:
        d.stop()


@test
def test_cpr_reboot_to_a_file_as_qemu():
    """cpr-reboot to file: from QEMU 10 and from qmigd (with a guest
    writing), each file loaded by a qmigd and a QEMU 10 destination."""
    for kind in ("qemu", "qmigd"):
        path = f"/dev/shm/{unique_name('cpr')}.mig"
        with images(SIZE, "mixed") as imgs:
            _, s_img, d_img, _ = imgs[0]
            src = Peer(kind, "source", [("mem", s_img, SIZE)], "ms")
            guest = Guest(s_img, rate=20000, pattern="hot", hot_set=SIZE) if kind == "qmigd" \
                else None
            try:
                info = cpr_reboot_save(src, path)
                if guest:
                    written = guest.pages_written()
                    check(guest.record()[:2] == (1, 1), f"guest not paused: {guest.record()}")
            finally:
                stop_all(guest, src)
            for dst_kind in ("qmigd", "qemu"):
                remove(d_img)
                load_file(dst_kind, d_img, path, SIZE)
                check(files_equal(s_img, d_img), f"{kind} -> file -> {dst_kind}: images differ")
            remove(path)
            print(f"  {kind} source: downtime {info['downtime']} of {info['total-time']} ms, "
                  f"{info['ram']['downtime-bytes'] >> 20} MiB sent stopped"
                  + (f" (guest paused after {written} pages)" if guest else "")
                  + "; loaded by qmigd and QEMU 10, images equal")


if __name__ == "__main__":
    main()
