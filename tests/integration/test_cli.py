#!/usr/bin/env python3
"""What a newcomer types first: qmigd's and qmig's version and help, a
mistyped command, QEMU's size syntax in --ram and in qmig run, Ctrl-C of a
migration qmig started (cancelled on both sides, no traceback), and the
destination's `info migrate` next to a QEMU 10 destination's."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

from itest import test, main, check
from runner import (Peer, QMIGD, make_image, migrate, remove, start_incoming, unique_name,
                    wait_status, stop_all)
import runner  # noqa: E402
from waiting import wait_until

QMIG = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "qmig")
MiB = 1 << 20


def run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, **kw)


@test
def test_versions_and_a_mistyped_command():
    for argv in ([QMIGD, "--version"], [QMIGD, "version"]):
        r = run(argv)
        check(r.returncode == 0 and r.stdout.startswith("qmigd version "), r)
    r = run([QMIGD, "src"])
    check(r.returncode == 2 and "unknown command 'src'" in r.stderr and "dest" in r.stderr, r)
    r = run([QMIG, "--version"])
    check(r.returncode == 0 and "qmigd version " in r.stdout, r)
    r = run([QMIGD, "dest", "--help"])
    check("addr=GPA" in r.stdout and "1.5G" in r.stdout, r.stdout)


@test
def test_help_into_a_closed_pipe():
    r = subprocess.run(f"{QMIG} --help | head -1; {QMIG} run --help | head -1", shell=True,
                       capture_output=True, text=True, timeout=30)
    check("Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr)
    lines = run([QMIG, "run", "--help"]).stdout.split("\n")
    for opt in ("--uri", "--zpd", "--max-bandwidth", "--events", "--verify", "--timeout"):
        at = next(i for i, ln in enumerate(lines) if ln.strip().startswith(opt))
        said = lines[at].strip().split("  ", 1)[1:]  # help on the option's own line
        for ln in lines[at + 1:]:
            if not ln.strip() or ln.strip().startswith("-"):
                break
            said.append(ln.strip())
        check(" ".join(said).strip(), f"qmig run --help says nothing of {opt}")


@test
def test_ram_sizes_in_qemu_syntax():
    for size, want in (("1.5M", 3 * MiB // 2), ("0x100000", MiB)):
        img = f"/dev/shm/{unique_name('size')}.ram"
        try:
            p = Peer("qmigd", "dest", [("mem", img, size)], "size")
            p.stop()
            check(os.path.getsize(img) == want, f"size={size}: {os.path.getsize(img)}")
        finally:
            remove(img)
    img = f"/dev/shm/{unique_name('size')}.ram"
    r = run([QMIGD, "dest", "--qmp", f"/tmp/{unique_name('size')}.qmp",
             "--ram", f"mem={img},size=1.5"])
    check(r.returncode != 0 and "256M, 1.5G, 0x10000000" in r.stderr, r)
    check(not os.path.exists(img), "an image was made for a bad size")


@test
def test_a_qmp_socket_in_a_missing_directory_says_so():
    img = f"/dev/shm/{unique_name('nodir')}.ram"
    r = run([QMIGD, "dest", "--qmp", f"/tmp/{unique_name('nodir')}/x.qmp",
             "--ram", f"mem={img},size=1M"])
    check(r.returncode != 0 and "No such file or directory" in r.stderr, r)
    check(not os.path.exists(img), "an image was left behind")


@test
def test_a_failed_start_removes_the_images_it_created():
    """A start that fails after its RAM images are open (a second --ram
    that cannot be made, --runas, --metrics, --qmp in a missing directory)
    removes the image files it created, and keeps one that was there."""
    img = f"/dev/shm/{unique_name('failed-start')}.ram"
    kept = f"/dev/shm/{unique_name('failed-start-kept')}.ram"
    try:
        make_image(kept, 16 << 20, "random")
        for bad in (["--ram", "m2=/nonexistent/qmigd/y,size=16M"],
                    ["--runas", "qmigd-no-such-user"],
                    ["--metrics", "127.0.0.1:99999"]):
            r = run([QMIGD, "dest", "--qmp", f"/tmp/{unique_name('fs')}.qmp",
                     "--ram", f"mem={img},size=64M", "--ram", f"old={kept},size=16M", *bad])
            check(r.returncode != 0, f"{bad}: started")
            check(not os.path.exists(img), f"{bad}: the image it created was left behind")
            check(os.path.getsize(kept) == 16 << 20, f"{bad}: an image that was there went")
        r = run([QMIGD, "dest", "--qmp", "/nonexistent/qmigd/x.qmp", "--ram",
                 f"mem={img},size=64M"])
        check(r.returncode != 0 and not os.path.exists(img), "bad --qmp: image left behind")
    finally:
        remove(img)
        remove(kept)


def pair(size, source_stopped=False):
    """A qmigd source and destination. source_stopped: the test stops the
    source (SIGSTOP) on purpose, which the loop-stall guard would take for
    a stalled loop: that source runs without it."""
    s_img, d_img = (f"/dev/shm/{unique_name(t)}.ram" for t in ("cli-src", "cli-dst"))
    make_image(s_img, size, "random")
    guard = runner.loop_watch and runner.loop_watch.STALL_GUARD
    if source_stopped and guard:
        runner.loop_watch.STALL_GUARD = False
    try:
        src = Peer("qmigd", "source", [("mem", s_img, size)], "cli-src")
    finally:
        if source_stopped and guard:
            runner.loop_watch.STALL_GUARD = guard
    dst = Peer("qmigd", "dest", [("mem", d_img, size)], "cli-dst")
    return src, dst, (s_img, d_img)


# A progress line: qmig prints the first as it enters the loop that polls
# the migration, the one whose Ctrl-C cancels it.
PROGRESS = re.compile(r"^(setup|active) ", re.M)


def interrupt_when_active(proc, src):
    """Ctrl-C of qmig once the migration is active and qmig polls it: a
    Ctrl-C before, while qmig waits for migrate's answer, is another case."""
    out = []

    def read():
        for line in proc.stdout:
            out.append(line)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        wait_status(src, ("active",))
        wait_until("qmig's first progress line", lambda: PROGRESS.search("".join(out)),
                   seen=lambda: "".join(out))
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join()
    return "".join(out)


@test
def test_ctrl_c_of_qmig_run_cancels():
    src, dst, imgs = pair(64 * MiB)
    try:
        proc = subprocess.Popen([QMIG, "run", "--src", src.qmp_path, "--dst", dst.qmp_path,
                                 "--max-bandwidth", "4M"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        out = interrupt_when_active(proc, src)
        check(proc.returncode == 130, f"exit {proc.returncode}: {out}")
        check("Traceback" not in out and "interrupted: migration cancelled on the source" in out,
              out)
        wait_status(src, ("cancelled",), fail_on=("failed", "completed"))
        check(src.qmp.cmd("query-migrate-parameters")["max-bandwidth"] == 4 * MiB,
              "--max-bandwidth 4M is not 4 MiB/s")
        wait_status(dst, ("failed", "cancelled"), fail_on=())
    finally:
        try:
            stop_all(src, dst)
        finally:
            remove(*imgs)


@test
def test_ctrl_c_of_migrate_wait_cancels():
    src, dst, imgs = pair(64 * MiB)
    try:
        src.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 4 * MiB})
        port = start_incoming(dst)
        proc = subprocess.Popen([QMIG, src.qmp_path, "migrate", f"uri=tcp:127.0.0.1:{port}",
                                 "--wait"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        out = interrupt_when_active(proc, src)
        check(proc.returncode == 130 and "Traceback" not in out, f"exit {proc.returncode}: {out}")
        check("interrupted: migration cancelled" in out, out)
        wait_status(src, ("cancelled",), fail_on=("failed", "completed"))
    finally:
        try:
            stop_all(src, dst)
        finally:
            remove(*imgs)


def interrupt_with_the_source_stopped(argv):
    """qmig ARGV (a migration it waits for; SRC, DST and PORT in it replaced)
    against a qmigd pair, the source stopped (SIGSTOP) once qmig polls it,
    then Ctrl-C: qmig's exit status, output and seconds from Ctrl-C to exit."""
    src, dst, imgs = pair(64 * MiB, source_stopped=True)
    stopped = False
    try:
        src.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 4 * MiB})
        port = str(start_incoming(dst)) if any("PORT" in a for a in argv) else ""
        argv = [a.replace("SRC", src.qmp_path).replace("DST", dst.qmp_path).replace("PORT", port)
                for a in argv]
        proc = subprocess.Popen([QMIG, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        out = []
        reader = threading.Thread(target=lambda: out.extend(proc.stdout))
        reader.start()
        try:
            wait_status(src, ("active",))
            wait_until("qmig's first progress line", lambda: PROGRESS.search("".join(out)),
                       seen=lambda: "".join(out))
            os.kill(src.proc.pid, signal.SIGSTOP)
            stopped = True
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
            secs = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
            reader.join()
        return proc.returncode, "".join(out), secs
    finally:
        if stopped:
            os.kill(src.proc.pid, signal.SIGCONT)
        try:
            stop_all(src, dst)
        finally:
            remove(*imgs)


@test
def test_ctrl_c_with_the_source_stopped_acts_at_once():
    """A source whose monitor stopped answering (SIGSTOP): Ctrl-C of
    migrate --wait says the migration could not be cancelled; of qmig run,
    also cancels the destination, left migrating otherwise. Each waits 1 s
    for a cancel's answer (bound: 10 s, for a busy machine)."""
    rc, out, secs = interrupt_with_the_source_stopped(
        ["SRC", "migrate", "uri=tcp:127.0.0.1:PORT", "--wait"])
    print(f"  migrate --wait: exit {rc} {secs:.2f} s after Ctrl-C")
    check(rc == 130 and "could not be cancelled" in out and "Traceback" not in out, out)
    check(secs < 10, f"{secs:.1f} s from Ctrl-C to exit")
    rc, out, secs = interrupt_with_the_source_stopped(
        ["run", "--src", "SRC", "--dst", "DST", "--max-bandwidth", "4M"])
    print(f"  run: exit {rc} {secs:.2f} s after Ctrl-C")
    check(rc == 130 and "could not cancel the migration on the source" in out
          and "incoming migration cancelled on the destination" in out
          and "Traceback" not in out, out)
    check(secs < 10, f"{secs:.1f} s from Ctrl-C to exit")


@test
def test_a_monitor_that_stops_answering_is_exit_4():
    """migrate --wait, the source stopped: after QMIG_REPLY_WAIT (2 s here)
    of silence, exit 4 (the outcome unknown), never a traceback nor 1,
    which says the migration failed (a wrapper would resume the source)."""
    src, dst, imgs = pair(64 * MiB, source_stopped=True)
    try:
        src.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 4 * MiB})
        port = start_incoming(dst)
        proc = subprocess.Popen([QMIG, src.qmp_path, "migrate", f"uri=tcp:127.0.0.1:{port}",
                                 "--wait"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, "QMIG_REPLY_WAIT": "2"})
        wait_status(src, ("active",))
        os.kill(src.proc.pid, signal.SIGSTOP)
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            os.kill(src.proc.pid, signal.SIGCONT)
        check(proc.returncode == 4 and "not known" in out and "Traceback" not in out,
              f"exit {proc.returncode}: {out}")
    finally:
        try:
            stop_all(src, dst)
        finally:
            remove(*imgs)


def dest_info_after_migration(kind):
    s_img, d_img = (f"/dev/shm/{unique_name(t)}.ram" for t in ("info-src", "info-dst"))
    make_image(s_img, 16 * MiB, "mixed")
    src = Peer(kind, "source", [("mem", s_img, 16 * MiB)], "info-src")
    dst = Peer(kind, "dest", [("mem", d_img, 16 * MiB)], "info-dst")
    try:
        migrate(src, dst, multifd=False)
        wait_status(dst, ("completed",))
        return dst.qmp.hmp("info migrate"), dst.status()
    finally:
        try:
            stop_all(src, dst)
        finally:
            remove(s_img, d_img)


@test
def test_destination_info_migrate_as_qemu():
    """QEMU 10's destination keeps no timings: `total time: 0 ms` and a
    query-migrate of the status alone. qmigd's says the same."""
    q_text, q_info = dest_info_after_migration("qemu")
    m_text, m_info = dest_info_after_migration("qmigd")
    status = [ln for ln in q_text.split("\r\n") if ln.startswith(("Migration status", "total"))]
    for ln in status:
        check(ln in m_text.split("\r\n"), f"QEMU 10 says {ln!r}; qmigd:\n{m_text}")
    check(q_info == {"status": "completed"} and m_info.get("status") == "completed",
          f"QEMU {q_info}, qmigd {m_info}")


@test
def test_certs_in_one_command_serve_qemu():
    """qmig certs DIR, then a TLS migration (verify-peer on) from qmigd into
    a QEMU 10 destination, both ends using DIR as written."""
    d = f"/tmp/{unique_name('certs')}"
    s_img, d_img = (f"/dev/shm/{unique_name(t)}.ram" for t in ("certs-src", "certs-dst"))
    make_image(s_img, 16 * MiB, "mixed")
    src = dst = None
    try:
        # A comma in the name: the DN printed is the one QEMU's authz matches.
        r = run([QMIG, "certs", d, "--client-cn", "qmigd, client"])
        check(r.returncode == 0 and "CN=qmigd\\, client" in r.stdout, r)
        dn = r.stdout.rsplit("authz-list rule: ", 1)[1].strip()
        src = Peer("qmigd", "source", [("mem", s_img, 16 * MiB)], "certs-src")
        dst = Peer("qemu", "dest", [("mem", d_img, 16 * MiB)], "certs-dst")
        for p, endpoint in ((src, "client"), (dst, "server")):
            p.qmp.cmd("object-add", **{"qom-type": "tls-creds-x509", "id": "tls0", "dir": d,
                                       "endpoint": endpoint, "verify-peer": True})
        dst.qmp.cmd("object-add", **{"qom-type": "authz-list", "id": "authz0", "policy": "deny",
                                     "rules": [{"match": dn, "policy": "allow",
                                                "format": "exact"}]})
        dst.qmp.cmd("migrate-set-parameters", **{"tls-authz": "authz0"})
        si, di, _ = migrate(src, dst, multifd=True, params={"tls-creds": "tls0"})
        check(si["status"] == "completed" and di["status"] == "completed", (si, di))
        check(run([QMIG, "certs", d]).returncode == 2, "certs overwrote a directory")
        for argv in (["--client-cn", 'a"b'], ["--client-cn", "a\\b"], ["--dns", "x\ny"],
                     ["--ip", "not-an-address"], ["--days", "-1"], ["--days", "0"]):
            r = run([QMIG, "certs", d + "-new", *argv])
            check(r.returncode == 2 and "Traceback" not in r.stderr
                  and not os.path.exists(d + "-new"), (argv, r.returncode, r.stderr))
        with open(d + "-file", "w"):
            pass
        r = run([QMIG, "certs", d + "-file"])
        check(r.returncode == 2 and "Traceback" not in r.stderr, r)
    finally:
        for p in (src, dst):
            if p:
                p.stop()
        remove(s_img, d_img, d + "-file")
        shutil.rmtree(d, ignore_errors=True)


def complete(script, words, env=None):
    """COMPREPLY of the completion in scripts/completion/SCRIPT for the
    command line WORDS (the last one being completed)."""
    path = os.path.join(os.path.dirname(QMIG), "completion", script)
    func = "_" + script
    line = " ".join(f"'{w}'" for w in words)
    r = subprocess.run(["bash", "-c", f'source "{path}"; COMP_WORDS=({line}); '
                        f'COMP_CWORD={len(words) - 1}; {func}; printf "%s\\n" "${{COMPREPLY[@]}}"'],
                       capture_output=True, text=True, timeout=30, env=env)
    return r.stdout.split()


@test
def test_bash_completion():
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(QMIGD),
                                                  os.path.dirname(QMIG), os.environ["PATH"]])}
    check(complete("qmigd", ["qmigd", "de"], env) == ["dest"], "qmigd de<TAB>")
    check("--incoming" in complete("qmigd", ["qmigd", "dest", "--inc"], env), "--inc<TAB>")
    check(complete("qmigd", ["qmigd", "dest", "--page-path", "m"], env) == ["mapped"], "")
    check("--max-bandwidth" in complete("qmig", ["qmig", "run", "--max"], env), "run --max<TAB>")
    img = f"/dev/shm/{unique_name('compl')}.ram"
    p = Peer("qmigd", "dest", [("mem", img, MiB)], "compl")
    try:
        got = complete("qmig", ["qmig", p.qmp_path, "migrate-inc"], env)
        check(got == ["migrate-incoming"], f"the monitor's commands: {got}")
    finally:
        p.stop()
        remove(img)


@test
def test_completion_never_runs_what_a_monitor_names():
    """Command names are a monitor's to choose: a name that is shell code
    is neither run nor offered; the honest names beside it still are."""
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(QMIG), os.environ["PATH"]])}
    path = f"/tmp/{unique_name('evil')}.qmp"
    mark = f"/tmp/{unique_name('pwned')}"
    names = [f"$(touch {mark})", f"`touch {mark}`", f"a;touch {mark}", "*", "query-status"]
    srv = fake_monitor(path, names)
    try:
        got = complete("qmig", ["qmig", path, ""], env)
        check(not os.path.exists(mark), "completion ran a command name as shell code")
        check(got == ["query-status", "hmp", "wait", "events"], f"offered: {got}")
    finally:
        srv.close()
        remove(path, mark)


@test
def test_a_plot_that_cannot_be_written_stops_before_the_migration():
    """--plot into a missing directory or onto a directory: usage (exit 2)
    before migrate is sent, so a completed migration is never reported as
    a failed command."""
    src, dst, imgs = pair(MiB)
    try:
        port = start_incoming(dst)
        for png in ("/nonexistent/x.png", "/tmp"):
            r = run([QMIG, src.qmp_path, "migrate", f"uri=tcp:127.0.0.1:{port}",
                     "--wait", "--plot", png])
            check(r.returncode == 2 and "--plot" in r.stderr and "Traceback" not in r.stderr,
                  (png, r.returncode, r.stderr))
        check("status" not in src.status(), f"a migration started: {src.status()}")
    finally:
        src.stop()
        dst.stop()
        remove(*imgs)


@test
def test_an_installed_qmig_runs_the_qmigd_beside_it():
    """cmake --install into a prefix: its bin/qmig finds its bin/qmigd, not
    one on the PATH nor none; without it, it says so and exits 2."""
    build = os.path.dirname(os.path.dirname(QMIGD))
    prefix = f"/tmp/{unique_name('prefix')}"
    try:
        r = run(["cmake", "--install", build, "--prefix", prefix])
        check(r.returncode == 0, r.stderr)
        env = {k: v for k, v in os.environ.items() if k != "QMIGD"}
        env["PATH"] = "/usr/bin:/bin"
        qmigd = os.path.join(prefix, "bin", "qmigd")
        r = run([os.path.join(prefix, "bin", "qmig"), "--version"], env=env)
        check(r.returncode == 0 and "qmigd version " in r.stdout and qmigd in r.stdout, r)
        os.unlink(qmigd)
        r = run([os.path.join(prefix, "bin", "qmig"), "--version"], env=env)
        check(r.returncode == 2 and f"no qmigd at {qmigd}" in r.stderr, r)
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


def fake_socket(path, speak):
    """A unix socket on `path` whose server runs speak(conn) for each client
    (in a thread) until the socket is closed (returned)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                try:
                    speak(c)
                except OSError:
                    pass  # the client went: what these tests want of it
    threading.Thread(target=serve, daemon=True).start()
    return srv


def fake_monitor(path, names):
    """A QMP server on `path` that calls its commands `names`: what a socket
    in /tmp may say to whoever completes a command line against it."""
    def speak(c):
        with c.makefile("rwb") as f:
            f.write(b'{"QMP": {"version": {}, "capabilities": []}}\n')
            f.flush()
            for line in f:
                req = json.loads(line)
                ret = ([{"name": n} for n in names]
                       if req.get("execute") == "query-commands" else {})
                f.write(json.dumps({"return": ret, "id": req.get("id")}).encode() + b"\n")
                f.flush()
    return fake_socket(path, speak)


def hmp_monitor(c):
    c.sendall(b"QEMU 10.0.2 monitor - type 'help' for more information\r\n(qemu) ")
    c.recv(4096)


def endless_line(c):
    while True:
        c.sendall(b"x" * (1 << 20))


@test
def test_a_socket_that_is_not_qmp_is_exit_3():
    """QEMU's HMP monitor and a peer that streams without a line end: qmig
    says it is not QMP and exits 3 (cannot connect), having read at most
    16 MiB; never a traceback."""
    for speak in (hmp_monitor, endless_line):
        path = f"/tmp/{unique_name('notqmp')}.sock"
        srv = fake_socket(path, speak)
        try:
            r = run([QMIG, path, "query-status"])
            check(r.returncode == 3 and "not a QMP monitor" in r.stderr
                  and "Traceback" not in r.stderr, (speak.__name__, r.returncode, r.stderr))
        finally:
            srv.close()
            remove(path)


if __name__ == "__main__":
    main()
