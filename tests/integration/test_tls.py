#!/usr/bin/env python3
"""TLS migrations (tls-creds-x509, GnuTLS) against QEMU 10, both ways.

Certificates are made at test time with certtool (scripts/lib/tls_certs.py).
Byte-identical images QEMU -> qmigd, qmigd -> QEMU and qmigd -> qmigd for
plain precopy, 4 multifd channels, multifd with zstd, over fd: (a socket
handed over with getfd, as libvirt does) and over exec: (a command that
joins its stdin and stdout to a TCP connection); credentials from
QMP object-add and from the --object option (QEMU's -object syntax). What
must fail, compared with what QEMU 10 says in the same place: a server
certificate from another CA ("The certificate hasn't got a known issuer"),
a hostname the certificate does not carry, an expired certificate, a
client DN the destination's authz-list denies, a plain source into a TLS
destination and a TLS source into a plain one, TLS over fd: without a
hostname, credentials that do not
exist or have the wrong endpoint, a world-readable private key. After each
failure the qmigd peer migrates again."""
import os
import shutil
import socket
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "lib"))
import tls_certs  # noqa: E402
from itest import test, main, check, cleanup  # noqa: E402
from fixtures import images, peers, hand_over_socketpair, MiB, strangers_cannot_end_it  # noqa: E402,E501
from runner import (start_incoming, wait_status, files_equal, migrate, sandbox_spawning,  # noqa: E402
                    proc_status)
from qmp import QMPError  # noqa: E402
from waiting import wait_until, wait_file, wait_text, tcp_sockets, TcpSocket  # noqa: E402

SIZE = 64 * MiB
ROOT = tempfile.mkdtemp(prefix="qmigd-tls-")
CA = tls_certs.CA(ROOT)
OTHER_CA = tls_certs.CA(ROOT, "another CA")
SERVER = CA.issue(f"{ROOT}/server", "server", "localhost")
CLIENT = CA.issue(f"{ROOT}/client", "client", "qmigd client")
ROGUE_SERVER = OTHER_CA.issue(f"{ROOT}/rogue-server", "server", "localhost")
ROGUE_CLIENT = OTHER_CA.issue(f"{ROOT}/rogue-client", "client", "qmigd client")
EXPIRED_SERVER = CA.issue(f"{ROOT}/expired-server", "server", "localhost",
                          dates=("2020-01-01 00:00:00", "2020-02-01 00:00:00"))
DIRECTIONS = [("qemu", "qmigd"), ("qmigd", "qemu"), ("qmigd", "qmigd")]


def creds(peer, server_dir=SERVER, client_dir=CLIENT, id_="tls0"):
    """tls-creds-x509 on a peer, for its role, through QMP."""
    d = server_dir if peer.role == "dest" else client_dir
    peer.qmp.cmd("object-add", **{"qom-type": "tls-creds-x509", "id": id_, "dir": d,
                                  "endpoint": "server" if peer.role == "dest" else "client",
                                  "verify-peer": True})


def tls_run(s, d, multifd, params=None, channels=4):
    p = {"tls-creds": "tls0"}
    p.update(params or {})
    return migrate(s, d, multifd, channels, "multifd", params=p)


def cell(src_kind, dst_kind, multifd, compression=None):
    def fn():
        with images(SIZE, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
            creds(s)
            creds(d)
            extra = {"multifd-compression": compression} if compression else None
            si, di, _ = tls_run(s, d, multifd, extra)
            check(si["status"] == "completed" and di["status"] == "completed")
            _, sp, dp, _ = imgs[0]
            check(files_equal(sp, dp), "images differ after a TLS migration")
    fn.__name__ = (f"test_tls_{src_kind}_to_{dst_kind}_{'mf4' if multifd else 'plain'}"
                   f"{'_' + compression if compression else ''}")
    test(fn)


for src_kind, dst_kind in DIRECTIONS:
    cell(src_kind, dst_kind, False)
    cell(src_kind, dst_kind, True)
    cell(src_kind, dst_kind, True, "zstd")


@test
def test_objects_from_the_command_line():
    src_obj = ["--object", f"tls-creds-x509,id=tls0,dir={CLIENT},endpoint=client"]
    dst_obj = ["--object", f"tls-creds-x509,id=tls0,dir={SERVER},endpoint=server,verify-peer=on"]
    with images(SIZE, "mixed") as imgs, \
            peers("qmigd", "qmigd", imgs, src_obj, dst_obj) as (s, d):
        tls_run(s, d, True)
        _, sp, dp, _ = imgs[0]
        check(files_equal(sp, dp))


def source_failure(dst_dir, expect, params=None, dst_kind="qmigd"):
    """A qmigd source and a QEMU source against the same kind of bad
    destination certificate: both fail, with the same error-desc; the qmigd
    source then migrates to a good destination."""
    descs = {}
    for src_kind in ("qemu", "qmigd"):
        with images(16 * MiB, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
            creds(s)
            creds(d, server_dir=dst_dir)
            p = {"tls-creds": "tls0"}
            p.update(params or {})
            s.set_migration(True, 2, "multifd", extra_params=p)
            d.set_migration(True, 2, extra_params={"tls-creds": "tls0"})
            port = start_incoming(d)
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            info = wait_status(s, ("failed",), timeout=30, fail_on=("completed",))
            descs[src_kind] = info.get("error-desc", "")
    check(expect in descs["qmigd"], f"qmigd said {descs['qmigd']!r}, wanted {expect!r}")
    check(descs["qmigd"] == descs["qemu"], descs)


@test
def test_server_certificate_from_another_ca():
    source_failure(ROGUE_SERVER, "The certificate hasn't got a known issuer")


@test
def test_hostname_the_certificate_lacks():
    source_failure(SERVER, "Certificate does not match the hostname other.example",
                   {"tls-hostname": "other.example"})


@test
def test_expired_server_certificate():
    source_failure(EXPIRED_SERVER, "The certificate")


def wait_log(peer, text):
    """Until peer's log holds text."""
    wait_text(peer.log_text, text, where=f"{peer.kind} {peer.role}'s log")


def refused_then_served(s, d, port, expect):
    """The destination refused the source's handshake. As QEMU 10's
    migration_tls_incoming_handshake: the source fails, the destination
    says why (its log; QEMU's stderr) and goes on listening, so whoever can
    reach the port without credentials cannot end the incoming migration.
    The same listener then takes a good source, byte-identical."""
    wait_status(s, ("failed",), timeout=30, fail_on=("completed",))
    if expect and d.kind == "qmigd":
        wait_log(d, expect)  # it has refused: it listens on, in setup
    check(d.status()["status"] == "setup", f"{d.kind} destination: {d.status()}")
    if s.kind == "qmigd":
        s.qmp.cmd("cont")
    migrate_to_listener(s, d, port)


@test
def test_strangers_cannot_end_a_tls_incoming_migration():
    """Without a handshake, nothing a stranger does ends it: resets and
    half records before the source, plain headers while it loads."""
    with images(SIZE, "random") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        creds(s)
        creds(d)
        strangers_cannot_end_it(s, d, imgs, True, {"tls-creds": "tls0"},
                                ignored="connection closed, still listening")


def migrate_to_listener(s, d, port):
    """A good TLS source (2 channels) into d's listener, still open on port."""
    s.set_migration(True, 2, "multifd", extra_params={"tls-creds": "tls0"})
    s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
    wait_status(s, ("completed",), timeout=60, fail_on=("failed",))
    wait_status(d, ("completed",), timeout=60, fail_on=("failed",))


def dest_refusal(src_params, expect, src_creds=None):
    """A source the destination's TLS refuses, into a QEMU 10 and a qmigd
    destination: both refuse it and go on listening."""
    for dst_kind in ("qemu", "qmigd"):
        with images(16 * MiB, "mixed") as imgs, peers("qmigd", dst_kind, imgs) as (s, d):
            if src_creds:
                src_creds(s)
            creds(s)
            creds(d)
            s.set_migration(True, 2, "multifd", extra_params=src_params)
            d.set_migration(True, 2, extra_params={"tls-creds": "tls0"})
            port = start_incoming(d)
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
            refused_then_served(s, d, port, expect)
            _, sp, dp, _ = imgs[0]
            check(files_equal(sp, dp), "the good migration after a refused one differs")


def authz_migration(dst_kind, policy, rules, expect_ok, client_dir=CLIENT, multifd=True):
    """A TLS migration into a destination whose authz-list has `policy` and
    `rules`: completes, or (denied) the source fails while the destination
    listens on and, where it is qmigd, says why in its log."""
    with images(16 * MiB, "mixed") as imgs, peers("qmigd", dst_kind, imgs) as (s, d):
        creds(s, client_dir=client_dir)
        creds(d)
        d.qmp.cmd("object-add", **{"qom-type": "authz-list", "id": "auth0", "policy": policy,
                                   "rules": rules})
        s.set_migration(multifd, 2, "multifd", extra_params={"tls-creds": "tls0"})
        d.set_migration(multifd, 2, extra_params={"tls-creds": "tls0", "tls-authz": "auth0"})
        port = start_incoming(d)
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        if expect_ok:
            wait_status(s, ("completed",), timeout=30)
            wait_status(d, ("completed",), timeout=30)
            return
        wait_status(s, ("failed",), timeout=30, fail_on=("completed",))
        if dst_kind == "qmigd":  # it has denied the client: it listens on, in setup
            wait_log(d, "TLS x509 authz check for")
            wait_log(d, "is denied")
        check(d.status()["status"] == "setup", f"{dst_kind}: {d.status()}")


@test
def test_authz_list_denies_a_client():
    def run(rule_match, expect_ok, dst_kind="qmigd"):
        authz_migration(dst_kind, "deny", [{"match": rule_match, "policy": "allow"}], expect_ok)
    run(tls_certs.client_dn("qmigd client"), True)
    run(tls_certs.client_dn("qmigd client"), True, "qemu")  # the same DN text lets QEMU in
    run(tls_certs.client_dn("someone else"), False)
    run(tls_certs.client_dn("someone else"), False, "qemu")


LONG_CLIENT = CA.issue(f"{ROOT}/long-client", "client", "qmigd client",
                      units=[f"unit {i} " + "x" * 50 for i in range(20)])


@test
def test_long_client_dn_is_checked_whole():
    """A client DN of 1,260 bytes (past any fixed buffer): a deny rule for
    it denies, an allow rule for it lets it in, on qmigd as on QEMU."""
    dn = tls_certs.subject_dn(LONG_CLIENT, "client")
    check(len(dn) > 1024, len(dn))

    def run(policy, rule_policy, expect_ok, dst_kind):
        authz_migration(dst_kind, policy, [{"match": dn, "policy": rule_policy}], expect_ok,
                        client_dir=LONG_CLIENT, multifd=False)
    for kind in ("qmigd", "qemu"):
        run("allow", "deny", False, kind)  # a deny-list that names it
        run("deny", "allow", True, kind)   # an allow-list that names it


OBJECT_ADD_CASES = [
    {"qom-type": "authz-list", "id": "a1", "rules": [{"match": "x", "policy": "allow", "bogus": 1}]},
    {"qom-type": "authz-list", "id": "a2", "rules": [{"match": "x", "policy": "allow", "format": 5}]},
    {"qom-type": "authz-list", "id": "a3", "rules": [{"match": 5, "policy": "allow"}]},
    {"qom-type": "authz-list", "id": "a4", "rules": [{"policy": "allow"}]},
    {"qom-type": "authz-list", "id": "a5", "rules": [{"match": "x"}]},
    {"qom-type": "authz-list", "id": "a6", "rules": "x"},
    {"qom-type": "authz-list", "id": "a7", "bogus": 1},
    {"qom-type": "authz-list", "id": "a8", "policy": 5},
    {"qom-type": "authz-list", "id": "a9", "rules": [5]},
    {"qom-type": "authz-list", "id": "a10", "rules": [{"match": "x", "policy": "allow",
                                                      "format": "regex"}]},
    {"qom-type": "authz-list", "id": "a11", "rules": [{"match": "x", "policy": "maybe"}]},
    {"qom-type": "authz-list", "id": 5},
    {"qom-type": "authz-list"},
    {"qom-type": "tls-creds-x509", "id": "t1", "dir": "/nonexistent", "endpoint": "server",
     "bogus": 1},
    {"qom-type": "tls-creds-x509", "id": "t2", "dir": 5},
    {"qom-type": "tls-creds-x509", "id": "t3", "dir": "/x", "verify-peer": "yes"},
    {"qom-type": "tls-creds-x509", "id": "t4", "dir": "/x", "endpoint": "both"},
    {"qom-type": "authz-list", "id": "ok", "policy": "deny",
     "rules": [{"match": "x", "policy": "allow", "format": "glob"}]},
]


@test
def test_object_add_errors_as_qemu():
    """Wrongly typed and unknown members of object-add: QEMU's words, and
    the daemon goes on (a wrongly typed rule format used to abort it)."""
    with images(4 * MiB, "zero") as imgs, peers("qemu", "qmigd", imgs) as (q, o):
        for args in OBJECT_ADD_CASES:
            got = []
            for p in (q, o):
                r = p.qmp.execute("object-add", args)
                got.append(r.get("error", {}).get("desc", "ok"))
            check(got[0] == got[1], f"{args}: QEMU {got[0]!r}, qmigd {got[1]!r}")
        check(o.proc.poll() is None and "return" in o.qmp.execute("query-status"))


@test
def test_client_certificate_from_another_ca():
    # GnuTLS sends no certificate the server's CA did not sign: QEMU's
    # words for that are the same.
    dest_refusal({"tls-creds": "rogue"}, "Verify failed: No certificate was found.",
                 lambda s: creds(s, client_dir=ROGUE_CLIENT, id_="rogue"))


def unix_tls(src_kind):
    """TLS over a unix socket: the URI has no host, so the server's name is
    tls-hostname; without one the source refuses, as QEMU 10 does."""
    path = f"/tmp/qmigd-tls-{os.getpid()}-{src_kind}.sock"
    try:
        with images(SIZE, "mixed") as imgs, peers(src_kind, "qmigd", imgs) as (s, d):
            creds(s)
            creds(d)
            s.set_migration(True, 4, "multifd", extra_params={"tls-creds": "tls0"})
            d.set_migration(True, 4, extra_params={"tls-creds": "tls0"})
            d.qmp.cmd("migrate-incoming", uri=f"unix:{path}")
            s.qmp.cmd("migrate", uri=f"unix:{path}")
            desc = wait_status(s, ("failed",), timeout=30, fail_on=("completed",))["error-desc"]
            check(desc == "No hostname for certificate validation", desc)
            wait_status(d, ("failed",), timeout=30, fail_on=("completed",))
            if src_kind == "qmigd":
                s.qmp.cmd("cont")
            migrate(s, d, True, 4, "multifd", unix_path=path,
                    params={"tls-creds": "tls0", "tls-hostname": "localhost"})
            _, sp, dp, _ = imgs[0]
            check(files_equal(sp, dp))
    finally:
        if os.path.exists(path):
            os.unlink(path)


@test
def test_tls_over_unix_qemu_to_qmigd():
    unix_tls("qemu")


@test
def test_tls_over_unix_qmigd_to_qmigd():
    unix_tls("qmigd")


def one_channel_tls(s, d, hostname="localhost"):
    """Credentials on both, plain precopy (fd: and exec: have one channel)
    over TLS; no URI host, so the server's name is tls-hostname."""
    creds(s)
    creds(d)
    params = {"tls-creds": "tls0"}
    if hostname:
        params["tls-hostname"] = hostname
    s.set_migration(False, 2, "legacy", extra_params=params)
    d.set_migration(False, 2, extra_params={"tls-creds": "tls0"})


def completed_identical(s, d, imgs, what):
    wait_status(s, ("completed",), timeout=60, fail_on=("failed",))
    wait_status(d, ("completed",), timeout=60, fail_on=("failed",))
    _, sp, dp, _ = imgs[0]
    check(files_equal(sp, dp), f"{what}: the images differ")


def fd_tls(src_kind, dst_kind):
    """TLS over fd: (libvirt's way: its own connection, QEMU's TLS)."""
    with images(SIZE, "mixed") as imgs, peers(src_kind, dst_kind, imgs) as (s, d):
        one_channel_tls(s, d)
        hand_over_socketpair(s, d)
        d.qmp.cmd("migrate-incoming", uri="fd:mig")
        s.qmp.cmd("migrate", uri="fd:mig")
        completed_identical(s, d, imgs, f"{src_kind} -> {dst_kind}, TLS over fd:")


for src_kind, dst_kind in DIRECTIONS:
    def fn(src_kind=src_kind, dst_kind=dst_kind):
        fd_tls(src_kind, dst_kind)
    fn.__name__ = f"test_tls_over_fd_{src_kind}_to_{dst_kind}"
    test(fn)


STDIO_TCP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stdio_tcp.py")


def wait_port_file(path):
    wait_file(path)  # stdio_tcp.py writes it whole, under another name first
    with open(path) as f:
        return int(f.read())


def exec_tls(src_kind, dst_kind):
    """TLS over exec: (QEMU's command channel is the command's stdin and
    stdout): a qmigd source's command connects to the destination, a qmigd
    destination's command listens for the source (tests/integration/
    stdio_tcp.py); a QEMU peer listens or connects over tcp: itself.
    Byte-identical."""
    port_file = f"/tmp/qmigd-tls-exec-{os.getpid()}-{src_kind}-{dst_kind}.port"
    try:
        with sandbox_spawning(), images(SIZE, "mixed") as imgs, \
                peers(src_kind, dst_kind, imgs) as (s, d):
            one_channel_tls(s, d)
            if dst_kind == "qmigd":
                d.qmp.cmd("migrate-incoming", uri=f"exec:python3 {STDIO_TCP} listen {port_file}")
                port = wait_port_file(port_file)
            else:
                port = start_incoming(d)
            s.qmp.cmd("migrate", uri=(f"exec:python3 {STDIO_TCP} connect {port}"
                                      if src_kind == "qmigd" else f"tcp:127.0.0.1:{port}"))
            completed_identical(s, d, imgs, f"{src_kind} -> {dst_kind}, TLS over exec:")
    finally:
        if os.path.exists(port_file):
            os.unlink(port_file)


for src_kind, dst_kind in DIRECTIONS:
    def fn(src_kind=src_kind, dst_kind=dst_kind):
        exec_tls(src_kind, dst_kind)
    fn.__name__ = f"test_tls_over_exec_{src_kind}_to_{dst_kind}"
    test(fn)


@test
def test_tls_over_file_refused():
    """A file cannot answer a handshake: qmigd says so (QEMU 10 starts one
    and fails in it), in both roles, and migrates to a file without TLS."""
    path = f"/tmp/qmigd-tls-file-{os.getpid()}.mig"
    try:
        with images(16 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
            creds(s)
            creds(d)
            s.set_migration(False, 2, "legacy", extra_params={"tls-creds": "tls0"})
            s.qmp.cmd("migrate", uri=f"file:{path}")
            desc = wait_status(s, ("failed",), timeout=30,
                               fail_on=("completed",)).get("error-desc", "")
            check(desc == "qmigd: TLS is not available on file: migration", desc)
            d.set_migration(False, 2, extra_params={"tls-creds": "tls0"})
            try:
                d.qmp.cmd("migrate-incoming", uri=f"file:{path}")
                check(False, "migrate-incoming file: with TLS was accepted")
            except QMPError as e:
                check("TLS is not available on file:" in str(e), str(e))
            s.set_migration(False, 2, "legacy", extra_params={"tls-creds": ""})
            s.qmp.cmd("migrate", uri=f"file:{path}")
            wait_status(s, ("completed",), timeout=60, fail_on=("failed",))
    finally:
        if os.path.exists(path):
            os.unlink(path)


@test
def test_tls_over_fd_without_hostname_as_qemu():
    """No tls-hostname and no host in fd:: QEMU 10's source fails with
    "No hostname for certificate validation"; qmigd's says the same."""
    descs = {}
    for src_kind in ("qemu", "qmigd"):
        with images(16 * MiB, "mixed") as imgs, peers(src_kind, "qmigd", imgs) as (s, d):
            one_channel_tls(s, d, hostname=None)
            hand_over_socketpair(s, d)
            d.qmp.cmd("migrate-incoming", uri="fd:mig")
            s.qmp.cmd("migrate", uri="fd:mig")
            descs[src_kind] = wait_status(s, ("failed",), timeout=30,
                                          fail_on=("completed",)).get("error-desc", "")
    check(descs["qmigd"] == "No hostname for certificate validation", descs)
    check(descs["qmigd"] == descs["qemu"], descs)


@test
def test_plain_source_into_tls_fd_destination():
    """fd: has one channel and no listener to go on with: a qmigd
    destination whose handshake fails is failed, says why, and takes the
    next migration (QEMU 10 only prints the error and waits in setup for
    a channel that cannot come)."""
    with images(16 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        creds(s)
        creds(d)
        s.set_migration(False, 2, "legacy")
        d.set_migration(False, 2, extra_params={"tls-creds": "tls0"})
        hand_over_socketpair(s, d)
        d.qmp.cmd("migrate-incoming", uri="fd:mig")
        s.qmp.cmd("migrate", uri="fd:mig")
        info = wait_status(d, ("failed",), timeout=60, fail_on=("completed",))
        check("TLS handshake failed" in info.get("error-desc", ""), info)
        wait_status(s, ("failed",), timeout=60, fail_on=("completed",))
        s.qmp.cmd("cont")
        s.set_migration(False, 2, "legacy",
                        extra_params={"tls-creds": "tls0", "tls-hostname": "localhost"})
        hand_over_socketpair(s, d)
        d.qmp.cmd("migrate-incoming", uri="fd:mig")
        s.qmp.cmd("migrate", uri="fd:mig")
        completed_identical(s, d, imgs, "the TLS migration after a refused one")


@test
def test_plain_source_into_tls_destination():
    dest_refusal({"tls-creds": ""}, "TLS handshake failed")


@test
def test_tls_source_into_plain_destination():
    with images(16 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        creds(s)
        s.set_migration(True, 2, "multifd", extra_params={"tls-creds": "tls0"})
        d.set_migration(True, 2)
        port = start_incoming(d)
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(s, ("failed",), timeout=30, fail_on=("completed",))
        # Its ClientHellos are no channel of the destination's: ignored, as
        # a stranger's, and the listener takes the plain source that follows.
        wait_log(d, "ignored a connection that is no channel of this migration")
        check(d.status()["status"] == "setup", d.status())
        s.qmp.cmd("cont")
        s.set_migration(True, 2, "multifd", extra_params={"tls-creds": ""})
        s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        wait_status(s, ("completed",), timeout=60, fail_on=("failed",))
        wait_status(d, ("completed",), timeout=60, fail_on=("failed",))
        _, sp, dp, _ = imgs[0]
        check(files_equal(sp, dp))


def unread(port):
    """Bytes not yet read by the listener on 127.0.0.1:port, on each of its
    established connections (/proc/net/tcp's rx_queue, accepted or not)."""
    return [s.rx_queue for s in tcp_sockets()
            if s.state == TcpSocket.ESTABLISHED and s.lport == port]


@test
def test_stalled_client_hellos_hold_no_thread():
    """Stalled ClientHellos on a TLS listener: a connection gets a handshake
    thread only once its whole ClientHello record is in, so 100 that stall
    after the record header hold no thread, and while they are held open
    a good source's channels get through."""
    with images(16 * MiB, "mixed") as imgs, peers("qmigd", "qmigd", imgs) as (s, d):
        creds(s)
        creds(d)
        d.set_migration(True, 2, extra_params={"tls-creds": "tls0"})
        port = start_incoming(d)
        before = int(proc_status(d.proc.pid)["Threads"])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        for h in held:
            h.sendall(b"\x16\x03\x01\x02\x00")  # a 512-byte record that never comes
        # Once the daemon has read every header (the kernel holds no byte
        # of them unread), whatever it does with a stalled hello is done.
        wait_until("the destination to read the 100 record headers",
                   lambda: len(unread(port)) >= 100 and not any(unread(port)),
                   seen=lambda: unread(port))
        threads = int(proc_status(d.proc.pid)["Threads"])
        check(threads == before, f"{threads - before} threads for 100 stalled ClientHellos")
        check(d.status()["status"] == "setup")
        migrate_to_listener(s, d, port)
        _, sp, dp, _ = imgs[0]
        check(files_equal(sp, dp))
        for h in held:
            h.close()


@test
def test_creds_errors_as_qemu():
    # Where the sources connect: a listener that never accepts (the kernel
    # completes the connections), so only the credentials can fail.
    sink = socket.create_server(("127.0.0.1", 0), backlog=16)
    with images(4 * MiB, "zero") as imgs, peers("qemu", "qmigd", imgs) as (qs, qd), \
            peers("qmigd", "qemu", imgs) as (ms, md), sink:
        out = {}
        for kind, src, dst in (("qemu", qs, md), ("qmigd", ms, qd)):
            errs = []
            def attempt():
                try:
                    src.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{sink.getsockname()[1]}")
                except QMPError as e:
                    return "refused: " + str(e)
                info = wait_status(src, ("failed",), timeout=30, fail_on=("completed",))
                return "failed: " + info.get("error-desc", "")
            src.set_migration(False, extra_params={"tls-creds": "nosuch"})
            errs.append(attempt())
            # Server credentials on a source.
            src.qmp.cmd("object-add", **{"qom-type": "tls-creds-x509", "id": "srv",
                                         "dir": SERVER, "endpoint": "server"})
            src.set_migration(False, extra_params={"tls-creds": "srv"})
            errs.append(attempt())
            try:
                src.qmp.cmd("object-del", id="nosuch")
                errs.append("accepted")
            except QMPError as e:
                errs.append(str(e))
            src.qmp.cmd("object-del", id="srv")
            out[kind] = errs
        check(out["qemu"] == out["qmigd"], out)


@test
def test_world_readable_key_refused():
    d = f"{ROOT}/loose"
    shutil.copytree(CLIENT, d)
    os.chmod(f"{d}/client-key.pem", 0o644)
    with images(4 * MiB, "zero") as imgs, peers("qmigd", "qmigd", imgs) as (s, _):
        try:
            s.qmp.cmd("object-add", **{"qom-type": "tls-creds-x509", "id": "t", "dir": d,
                                       "endpoint": "client"})
            check(False, "a world-readable key was accepted")
        except QMPError as e:
            check("readable by other users" in str(e), str(e))


@cleanup
def remove_shared():
    shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()
