#!/usr/bin/env python3
"""qmigd installed as a host daemon: `cmake --install` lays out qmigd, qmig
and the units under a prefix, qmig runs from there and the units start that
prefix's qmigd; CPack's .deb declares its libraries, installs with apt on a
fresh Debian 12 (debootstrap, then only what the package pulls in), and
systemd booted in that system (systemd-nspawn) starts qmigd-dest@ from an
environment file as the README says: a qmigd source on this host parks a VM
into it over TCP, byte for byte, and the unit stops cleanly."""
import glob
import os
import re
import shutil
import subprocess
import tarfile
import tempfile

from itest import test, main, check, skip, run_ok as run
from fixtures import images, MiB
from runner import Peer, QMIGD, free_port, wait_status, files_equal, unique_name
from waiting import wait_until, DEADLINE

BUILD = os.path.dirname(os.path.dirname(os.path.abspath(QMIGD)))
SOURCE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# A minimal Debian 12 with systemd, made once per host (debootstrap takes
# ~30 s and the network); every test run unpacks a fresh copy of it.
CACHE = "/var/cache/qmigd-tests/bookworm-minbase-systemd.tar"
SIZE = 16 * MiB


def build_deb(out):
    run(["cpack", "-G", "DEB", "-B", out], cwd=BUILD)
    debs = [f for f in os.listdir(out) if f.endswith(".deb")]
    check(len(debs) == 1, debs)
    return os.path.join(out, debs[0])


@test
def test_cmake_install_layout():
    """bin/qmigd and bin/qmig (a link into lib/qmigd, its modules beside
    it), the units naming this prefix's qmigd and docs, the docs with every
    relative link resolving inside the install, the man pages (man renders
    them) and bash completions."""
    prefix = tempfile.mkdtemp(prefix="qmigd-prefix-")
    try:
        run(["cmake", "--install", BUILD, "--prefix", prefix])
        for rel in ("bin/qmigd", "bin/qmig", "lib/qmigd/lib/migrate_run.py",
                    "lib/systemd/system/qmigd-dest@.service",
                    "lib/systemd/system/qmigd-source@.service",
                    "share/doc/qmigd/README.md", "share/doc/qmigd/examples/dest.env.example",
                    "lib/qmigd/lib/tls_certs.py", "share/man/man1/qmigd.1",
                    "share/man/man1/qmig.1", "share/bash-completion/completions/qmigd",
                    "share/bash-completion/completions/qmig"):
            check(os.path.exists(os.path.join(prefix, rel)), f"{rel} not installed")
        check(os.path.islink(os.path.join(prefix, "bin/qmig")), "bin/qmig is not a link")
        with open(os.path.join(prefix, "lib/systemd/system/qmigd-dest@.service")) as f:
            unit = f.read()
        check(f"ExecStart={prefix}/bin/qmigd dest" in unit, unit)
        check(f"Documentation=file://{prefix}/share/doc/qmigd/docs/service.md" in unit, unit)
        docs = os.path.join(prefix, "share/doc/qmigd")
        for page in glob.glob(f"{docs}/*.md") + glob.glob(f"{docs}/docs/*.md"):
            text = re.sub(r"```.*?```", "", open(page).read(), flags=re.S)
            for target in re.findall(r"\]\(([^)\s#]+)[^)]*\)", text):
                if not target.startswith(("http://", "https://", "mailto:")):
                    path = os.path.normpath(os.path.join(os.path.dirname(page), target))
                    check(os.path.exists(path), f"installed {page}: {target} is not installed")
        for name, says in (("qmigd", "--incoming"), ("qmig", "--max-bandwidth")):
            page = run(["man", "-l", os.path.join(prefix, f"share/man/man1/{name}.1")],
                       env={**os.environ, "MANWIDTH": "100"})
            check("SYNOPSIS" in page and "SEE ALSO" in page and says in page, page[:2000])
        out = run([os.path.join(prefix, "bin/qmig"), "--help"])
        check("qmig SOCK COMMAND" in out, out)
        # qmig from the prefix drives a daemon (found on the PATH, not in build/)
        with images(SIZE, "zero") as imgs:
            p = Peer("qmigd", "dest", [("mem", imgs[0][2], SIZE)], "pkg-qmig")
            try:
                env = {**os.environ, "PATH": prefix + "/bin:/usr/bin:/bin"}
                out = run([os.path.join(prefix, "bin/qmig"), p.qmp_path, "query-migrate"],
                          env=env)
                check("{}" in out or "status" in out, out)
            finally:
                p.stop()
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


def fresh_debian(root):
    """Unpacks the cached minimal Debian 12 (making it first if need be)."""
    if not os.path.exists(CACHE):
        if not shutil.which("debootstrap"):
            skip("debootstrap is not installed (scripts/install-deps.sh installs it)")
        work = tempfile.mkdtemp(prefix="qmigd-debootstrap-", dir="/var/tmp")
        try:
            r = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", work,
                                "http://deb.debian.org/debian"], capture_output=True, text=True,
                               timeout=900)
            if r.returncode != 0:
                skip(f"debootstrap failed (no network to deb.debian.org?): {r.stderr[-300:]}", machine=True)
            shutil.copy("/etc/resolv.conf", os.path.join(work, "etc/resolv.conf"))
            run(["chroot", work, "apt-get", "install", "-y", "-qq", "--no-install-recommends",
                 "systemd", "systemd-sysv", "dbus"], timeout=600)
            run(["chroot", work, "apt-get", "clean"])
            os.makedirs(os.path.dirname(CACHE), exist_ok=True)
            with tarfile.open(CACHE + ".part", "w") as t:
                t.add(work, arcname=".")
            os.rename(CACHE + ".part", CACHE)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    with tarfile.open(CACHE) as t:
        t.extractall(root, numeric_owner=True)
    shutil.copy("/etc/resolv.conf", os.path.join(root, "etc/resolv.conf"))


class Booted:
    """systemd booted in root by systemd-nspawn, sharing this host's network."""

    def __init__(self, root, log):
        self.proc = subprocess.Popen(["systemd-nspawn", "-D", root, "--boot", "--register=no",
                                      "--keep-unit", "-M", unique_name("qmigd")[:60], "-q"],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.leader = None
        state = {"now": ""}

        def answering():
            check(self.proc.poll() is None,
                  f"systemd-nspawn exited with {self.proc.returncode} (state {state['now']!r})")
            kids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                  text=True).stdout.split()
            if not kids:
                return False
            self.leader = kids[0]
            state["now"] = self.sh("systemctl", "is-system-running", check_rc=False).strip()
            # Answering is enough: `systemctl start` queues behind the boot.
            return state["now"] in ("starting", "running", "degraded")
        try:
            # Each probe runs two processes: polled at a gentler pace.
            wait_until("the container's systemd to answer", answering, timeout=2 * DEADLINE,
                       every=0.2, seen=lambda: state["now"])
        except BaseException:
            self.poweroff()  # nothing of it may outlive the test
            raise

    def sh(self, *argv, check_rc=True, timeout=60):
        r = subprocess.run(["nsenter", "-t", self.leader, "-a"] + list(argv),
                           capture_output=True, text=True, timeout=timeout)
        if check_rc:
            check(r.returncode == 0, f"{argv}: {r.returncode} {r.stdout} {r.stderr}")
        return r.stdout

    def poweroff(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # nspawn halts the container's systemd
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@test
def test_deb_installs_on_fresh_debian_and_its_unit_parks_a_vm():
    for tool in ("cpack", "systemd-nspawn", "nsenter", "dpkg-deb"):
        if not shutil.which(tool):
            skip(f"{tool} is not installed (scripts/install-deps.sh installs it)")
    out = tempfile.mkdtemp(prefix="qmigd-deb-")
    root = tempfile.mkdtemp(prefix="qmigd-debian-", dir="/var/tmp")
    booted = None
    try:
        deb = build_deb(out)
        depends = run(["dpkg-deb", "-f", deb, "Depends"])
        for lib in ("libuv1", "libseccomp2", "libgnutls30", "libspdlog", "python3"):
            check(lib in depends, f"{lib} not in Depends: {depends}")
        fresh_debian(root)
        shutil.copy(deb, os.path.join(root, "tmp/qmigd.deb"))
        r = subprocess.run(["chroot", root, "apt-get", "install", "-y", "-qq",
                            "--no-install-recommends", "/tmp/qmigd.deb"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0 and re.search(r"Temporary failure resolving|Could not resolve|"
                                           r"Failed to fetch", r.stdout + r.stderr):
            skip(f"no network to deb.debian.org for the package's dependencies: {r.stderr[-300:]}", machine=True)
        check(r.returncode == 0, f"apt-get install ./qmigd.deb: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        check("qmigd" in run(["chroot", root, "qmigd", "--help"]), "qmigd --help")
        check("qmig SOCK" in run(["chroot", root, "qmig", "--help"]), "qmig --help")
        port = free_port()
        check(os.path.isdir(os.path.join(root, "etc/qmigd")), "the package made no /etc/qmigd")
        for f in ("usr/share/man/man1/qmigd.1", "usr/share/bash-completion/completions/qmig"):
            check(os.path.exists(os.path.join(root, f)), f"the package has no /{f}")
        with open(os.path.join(root, "etc/qmigd/dest-t1.env"), "w") as f:
            f.write(f"QMIGD_ARGS=--ram-dir /var/lib/qmigd/t1 --incoming tcp:127.0.0.1:{port}\n")
        log = open(os.path.join(os.environ.get("QMIGD_LOG_DIR", "/tmp"),
                                unique_name("nspawn") + ".log"), "w")
        booted = Booted(root, log)
        booted.sh("systemctl", "enable", "--now", "qmigd-dest@t1", timeout=120)
        check(booted.sh("systemctl", "is-active", "qmigd-dest@t1").strip() == "active",
              booted.sh("systemctl", "status", "qmigd-dest@t1", check_rc=False))
        status = booted.sh("systemctl", "show", "-p", "StatusText", "qmigd-dest@t1")
        check("destination: migration setup" in status, status)
        with images(SIZE, "mixed") as imgs:
            src = Peer("qmigd", "source", [("mem", imgs[0][1], SIZE)], "pkg-src")
            try:
                src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
                wait_status(src, ("completed",), 60)
            finally:
                src.stop()
            dest = {"said": ""}

            def completed():
                dest["said"] = booted.sh("qmig", "/run/qmigd/dest-t1.qmp", "query-migrate")
                return '"completed"' in dest["said"]
            wait_until("the unit's destination to complete", completed, every=0.2,
                       seen=lambda: dest["said"])
            parked = os.path.join(root, "var/lib/qmigd/t1/00-mem.img")
            check(files_equal(imgs[0][1], parked), "the parked image differs")
        journal = booted.sh("journalctl", "-u", "qmigd-dest@t1", "--no-pager")
        check("sandbox on" in journal, journal[-2000:])
        booted.sh("systemctl", "stop", "qmigd-dest@t1")
        check(booted.sh("systemctl", "is-active", "qmigd-dest@t1", check_rc=False).strip()
              == "inactive", "the unit did not stop")
    finally:
        if booted:
            booted.poweroff()
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
