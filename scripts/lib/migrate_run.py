"""`qmig run`: a scripted migration between two monitors, any mix of qmigd
and QEMU 10, given on the command line or in a JSON scenario file.

Scenario file (every key optional except source and destination):

{
  "source":      {"qmp": "/tmp/src.qmp"}
               | {"launch": "qmigd" | "qemu",
                  "ram": [{"name": "mem", "path": "/dev/shm/s.ram", "size": "1G",
                           "content": "mixed" | "random" | "zero" | "sparse" | "keep"}]},
  "destination": {"qmp": ...} | {"launch": ..., "ram": [...]}  (content: "fresh" | "garbage"),
  "capabilities": {"multifd": true, "events": true},
  "parameters": {"multifd-channels": 4, "zero-page-detection": "multifd", "max-bandwidth": 0},
  "source-parameters": {}, "destination-parameters": {},
  "uri": "tcp:127.0.0.1:0",
  "guest": {"rate": 20000, "pattern": "hot", "hot-set": "64M", "seed": 1},
  "postcopy-after": 2.5,
  "verify": true,
  "keep-images": false,
  "timeout": 600
}

Images of launched peers are made by the run and removed after it unless
"keep-images" is true.

"postcopy-after" (with capability postcopy-ram on both sides, which
--postcopy sets) sends migrate-start-postcopy that many seconds into the
migration; 0 switches at once: resuming a parked VM that way runs it in
milliseconds, its pages fetched as it touches them.

Port 0 in the uri asks the destination for a free port (read back from
query-migrate's socket-address, as QEMU 10 reports it).
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import time

from qmp import QMP, QMPError
from qmp_args import parse_args, parse_size, UsageError
import runner
from charts import require_matplotlib
from timeline import Timeline, unwritable
from waiting import wait_until, WaitTimeout

MiB = 1 << 20


def size_arg(text):
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Side:
    """One end: an existing monitor, or a process this run starts and stops."""

    def __init__(self, spec, role):
        self.spec, self.role, self.peer = spec, role, None
        self.images = []
        if "launch" in spec:
            ram = []
            for r in spec["ram"]:
                size = parse_size(r["size"])
                content = r.get("content", "mixed" if role == "source" else "fresh")
                if content in ("mixed", "random", "zero", "sparse", "garbage"):
                    runner.make_image(r["path"], size, content)
                elif content == "fresh":
                    runner.remove(r["path"])
                ram.append((r.get("name", "mem"), r["path"], size))
                self.images.append(r["path"])
            self.peer = runner.Peer(spec["launch"], role, ram, f"run-{role}")
            self.qmp = self.peer.qmp
        else:
            self.qmp = connect_monitor(spec["qmp"])
        self.kind = peer_label(self.qmp)

    def close(self, keep_images=False):
        if self.peer:
            self.peer.stop()
            if not keep_images:  # the images this run made
                runner.remove(*self.images)
        else:
            self.qmp.close()


# How long a command's answer is waited for once connected (a monitor's
# commands answer in milliseconds; QEMU's may take seconds at a switchover).
REPLY_WAIT = float(os.environ.get("QMIG_REPLY_WAIT", "30"))


class CannotConnect(Exception):
    """A monitor that cannot be reached; the message says what to do."""


def connect_monitor(path, wait=1.0):
    """A QMP connection, or CannotConnect within about `wait` seconds."""
    try:
        q = QMP(path, timeout=wait)
    except FileNotFoundError:
        raise CannotConnect(f"no monitor socket at {path}: start QEMU with -qmp "
                            f"unix:{path},server=on,wait=off or qmigd with --qmp {path}")
    except ConnectionRefusedError:
        raise CannotConnect(f"nothing listens on {path} (a stale socket file? the process "
                            f"that made it has exited)")
    except (TimeoutError, OSError) as e:
        if isinstance(e, TimeoutError) or "timed out" in str(e):
            raise CannotConnect(f"{path} accepted the connection but sent no QMP greeting "
                                f"within {wait:g} s: the monitor is busy (QEMU serves one QMP "
                                f"client at a time; close the other client)")
        raise CannotConnect(f"cannot connect to {path}: {e}")
    q.sock.settimeout(REPLY_WAIT)
    return q


def peer_label(qmp):
    """"QEMU 10.0.2" or "qmigd 0.9 (QEMU 10.0.2)", from query-version."""
    v = qmp.cmd("query-version")
    q = v["qemu"]
    ver = f"{q['major']}.{q['minor']}.{q['micro']}"
    pkg = v.get("package", "").strip()
    return f"{pkg} (QEMU {ver})" if pkg.startswith("qmigd") else f"QEMU {ver}"


def summary(status, secs, info):
    """The run's result, one line a script can parse, and the same as JSON."""
    ram = info.get("ram", {})
    rate = ram.get("transferred", 0) / secs / (1 << 30) if secs > 0 else 0.0
    d = {"status": status, "seconds": round(secs, 3), "downtime-ms": info.get("downtime"),
         "gib-per-second": round(rate, 3), "normal": ram.get("normal"),
         "zero": ram.get("duplicate")}
    line = " ".join(f"{k}={v}" for k, v in d.items())
    return "result: " + line, d


def configure(side, caps, params):
    if caps:
        side.qmp.cmd("migrate-set-capabilities",
                     capabilities=[{"capability": k, "state": v} for k, v in caps.items()])
    if params:
        side.qmp.cmd("migrate-set-parameters", dict(params))


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


class Progress:
    """A live bar on a terminal; one plain line a second otherwise."""

    def __init__(self, out=sys.stdout):
        self.out, self.tty, self.last, self.status = out, out.isatty(), 0.0, None

    def show(self, info):
        ram = info.get("ram")
        st = info.get("status", "?")
        now = time.monotonic()
        if not self.tty and now - self.last < 1.0 and st == self.status:
            return
        self.last, self.status = now, st
        if ram and ram.get("total"):
            pct = 100.0 * (1 - ram["remaining"] / ram["total"])
            text = (f"{st:<10} {pct:5.1f}%  {ram['mbps']:8.1f} Mbps  remaining "
                    f"{human(ram['remaining']):>10}  pass {ram['dirty-sync-count']}"
                    f"  dirty {ram['dirty-pages-rate']} pages/s")
            if "cpu-throttle-percentage" in info:
                text += f"  throttle {info['cpu-throttle-percentage']}%"
        else:
            pct, text = 0.0, f"{st:<10}"
        if self.tty:
            width = 24
            fill = int(width * pct / 100)
            self.out.write("\r[" + "#" * fill + "-" * (width - fill) + "] " + text + "\033[K")
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def done(self):
        if self.tty:
            self.out.write("\n")


class Postcopy:
    """With postcopy-after (seconds, 0 = at once): migrate-start-postcopy
    then, and the moment the destination runs the guest is reported."""

    def __init__(self, after, src, dst, t0, out):
        self.after, self.src, self.dst, self.t0, self.out = after, src, dst, t0, out
        self.asked = self.running = after is None

    def step(self, ask=True):
        now = time.monotonic() - self.t0
        if ask and not self.asked and now >= self.after:
            self.src.qmp.cmd("migrate-start-postcopy")
            self.asked = True
            print(f"switching to postcopy after {now:.2f} s", file=self.out, flush=True)
        if self.asked and not self.running:
            if self.dst.qmp.cmd("query-status").get("status") == "running":
                self.running = True
                print(f"the destination runs the guest {now:.3f} s after migrate", file=self.out,
                      flush=True)


def start_guest(spec, src):
    """qmigd guest writing the source's first image (live scenarios);
    returns once it writes, so that the migration starts on a live guest."""
    ram = src.spec["ram"][0]
    argv = [runner.QMIGD, "guest", "--ram", f"{ram.get('name', 'mem')}={ram['path']}",
            "--rate", str(spec.get("rate", 20000)), "--pattern", spec.get("pattern", "random"),
            "--seed", str(spec.get("seed", 1))]
    if "hot-set" in spec:
        argv += ["--hot-set", str(parse_size(spec["hot-set"]))]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until("the guest to write a page", lambda: guest_pages(proc, ram["path"]))
    except BaseException:
        runner.end_process(proc)
        raise
    return proc


def guest_pages(proc, image):
    """Pages the guest wrote so far, from its control record (beside the
    image, or in /dev/shm for hugetlbfs: runner.Guest's rule)."""
    if proc.poll() is not None:
        raise RuntimeError(f"qmigd guest exited with {proc.returncode}")
    control = image + ".ctl"
    if runner.fs_type(image) == "hugetlbfs":
        control = "/dev/shm/qmigd" + os.path.abspath(image).replace("/", "_") + ".ctl"
    try:
        with open(control, "rb") as f:
            return struct.unpack("<6I2Q", f.read(40))[7]
    except (OSError, struct.error):
        return 0  # not made yet


def run(scn, out=sys.stdout):
    src = dst = guest = None
    incoming = False
    if scn.get("plot") and unwritable(scn["plot"]):
        print(f"qmig run: --plot {unwritable(scn['plot'])}", file=out)
        return 2
    try:
        src = Side(scn["source"], "source")
        dst = Side(scn["destination"], "dest")
        caps = scn.get("capabilities", {})
        params = scn.get("parameters", {})
        dst_params = {k: v for k, v in params.items() if k != "zero-page-detection"}
        configure(src, caps, {**params, **scn.get("source-parameters", {})})
        configure(dst, caps, {**dst_params, **scn.get("destination-parameters", {})})
        uri = scn.get("uri", "tcp:127.0.0.1:0")
        dst.qmp.cmd("migrate-incoming", uri=uri)
        incoming = True  # ours to end if the run fails before the migration does
        host, port = uri[4:].rsplit(":", 1)
        if port == "0":
            port = dst.qmp.cmd("query-migrate")["socket-address"][0]["port"]
        if "guest" in scn:
            guest = start_guest(scn["guest"], src)
        print(f"migrating {src.kind} -> {dst.kind} via tcp:{host}:{port}", file=out, flush=True)
        t0 = time.monotonic()
        src.qmp.cmd("migrate", uri=f"tcp:{host}:{port}")
        incoming = False  # the migration's own end ends it from here on
        bar = Progress(out)
        postcopy = Postcopy(scn.get("postcopy-after"), src, dst, t0, out)
        timeline = Timeline(f"{src.kind} -> {dst.kind}") if scn.get("plot") else None

        def ended():
            postcopy.step()
            info = src.qmp.cmd("query-migrate")
            bar.show(info)
            if timeline:
                timeline.record(info)
            return info if info.get("status") in ("completed", "failed", "cancelled") else None
        try:
            # Sampled every 0.1 s: the bar's and the timeline's pace.
            info = wait_until("the migration to end", ended, scn.get("timeout", 600), every=0.1)
        except WaitTimeout:
            src.qmp.cmd("migrate_cancel")
            bar.done()
            print("timed out: cancelled", file=out)
            return 1
        bar.done()
        if info["status"] == "completed":
            # The destination may have run the guest and completed between
            # two samples: say so now, rather than not at all.
            postcopy.step(ask=False)
        if timeline:
            print(timeline.report(scn["plot"]), file=out)
        if info["status"] != "completed":
            print(f"source: migration {info['status']}: {info.get('error-desc', '')}", file=out)
            line, d = summary(info["status"], time.monotonic() - t0, info)
            print(json.dumps(d) if scn.get("json") else line, file=out, flush=True)
            return 1
        last = {}

        def dst_ended():
            d = last["info"] = dst.qmp.cmd("query-migrate")
            return d.get("status") in ("completed", "failed")
        try:
            wait_until("the destination to end", dst_ended)
        except WaitTimeout as e:
            print(f"destination: {e}", file=out)  # and the run fails: not completed
        dinfo = last["info"]
        secs = time.monotonic() - t0
        print(f"completed in {secs:.2f} s", file=out)
        for name, side in (("source", src), ("destination", dst)):
            print(f"=== {name} ({side.kind}): info migrate ===", file=out)
            print(side.qmp.hmp("info migrate").replace("\r\n", "\n"), file=out)
        rc = verify(scn, src, dst, out) if dinfo.get("status") == "completed" else 1
        line, d = summary(dinfo.get("status") if rc == 0 else "failed", secs, info)
        print(json.dumps(d) if scn.get("json") else line, file=out, flush=True)
        return rc
    except KeyboardInterrupt:
        interrupted(src, dst, out)
        return 130
    except QMPError:
        if incoming:
            # The destination listens for a migration this run will not
            # start: end it, so that the next run finds it free (a qmigd
            # destination cancels; a QEMU one has no way but quit).
            try:
                dst.qmp.execute("migrate_cancel")
            except OSError:
                pass
        raise
    finally:
        if guest:
            runner.end_process(guest)
        for side in (src, dst):
            if side:
                side.close(scn.get("keep-images", False))


# How long a Ctrl-C waits for each side's migrate_cancel.
CANCEL_WAIT = 1.0


def interrupted(src, dst, out):
    """Ctrl-C: cancel the migration this run started on both sides, as virsh
    migrate does: the source's, and the destination's, so that neither is
    left migrating when the other's monitor does not answer (a stopped
    source, a hung QEMU). Each side waited for 1 s at most; what could not
    be cancelled is said."""
    for side, what in ((src, "migration"), (dst, "incoming migration")):
        qmp = getattr(side, "qmp", None)
        if not qmp:
            continue
        where = "source" if side.role == "source" else "destination"
        try:
            reply = qmp.execute_within(CANCEL_WAIT, "migrate_cancel")
            if "error" in reply:
                raise QMPError(reply["error"]["class"], reply["error"]["desc"])
            print(f"\ninterrupted: {what} cancelled on the {where}", file=out)
        except (OSError, QMPError) as e:
            print(f"\ninterrupted: could not cancel the {what} on the {where}: {e}", file=out)


def verify(scn, src, dst, out):
    pairs = []
    v = scn.get("verify", False)
    if v is True:
        pairs = list(zip(src.images, dst.images))
    elif isinstance(v, list):
        pairs = [tuple(p) for p in v]
    for a, b in pairs:
        same = runner.files_equal(a, b)
        print(f"verify {a} == {b}: {'identical' if same else 'DIFFERENT'}", file=out)
        if not same:
            return 1
    return 0


def run_main(argv):
    ap = argparse.ArgumentParser(prog="qmig run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", nargs="?", help="JSON scenario file")
    ap.add_argument("--src", help="source QMP socket")
    ap.add_argument("--dst", help="destination QMP socket")
    ap.add_argument("--uri", default="tcp:127.0.0.1:0",
                    help="where the destination listens and the source connects (default "
                         "%(default)s: port 0 asks the destination for a free one)")
    ap.add_argument("--multifd", type=int, metavar="CHANNELS", help="enable multifd with N channels")
    ap.add_argument("--zpd", choices=["none", "legacy", "multifd"],
                    help="zero-page-detection on the source (default: the source's own, "
                         "multifd on QEMU 10 and qmigd)")
    ap.add_argument("--max-bandwidth", type=size_arg, metavar="BYTES_PER_S",
                    help="the source's max-bandwidth, in bytes per second with QEMU's units "
                         "(16M, 1G); 0 is no limit (default: the source's own, 128M on QEMU 10)")
    ap.add_argument("--events", action="store_true",
                    help="turn on the events capability (MIGRATION events on both monitors)")
    ap.add_argument("--postcopy", type=float, nargs="?", const=0.0, metavar="AFTER",
                    help="postcopy-ram on both sides, and migrate-start-postcopy AFTER seconds "
                         "into the migration (at once without a value): the destination runs "
                         "the guest at once and fetches what it touches")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a migration parameter for both sides")
    ap.add_argument("--verify", action="append", default=[], metavar="SRC_IMG:DST_IMG",
                    help="after completion, compare these two RAM images byte for byte "
                         "(repeatable); exit 1 if they differ")
    ap.add_argument("--timeout", type=float, default=600, metavar="SECONDS",
                    help="cancel the migration if it has not ended by then (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="the last line as JSON, not key=value")
    ap.add_argument("--plot", metavar="FILE.png",
                    help="a timeline chart of the migration (remaining, throughput, dirty "
                         "rate, each dirty sync, switchover and downtime, postcopy) and its "
                         "samples as FILE.json")
    a = ap.parse_args(argv)
    if a.scenario:
        with open(a.scenario) as f:
            scn = json.load(f)
    else:
        if not (a.src and a.dst):
            ap.error("give a scenario file or both --src and --dst")
        scn = {"source": {"qmp": a.src}, "destination": {"qmp": a.dst}}
    caps = scn.setdefault("capabilities", {})
    params = scn.setdefault("parameters", {})
    if a.multifd:
        caps["multifd"] = True
        params["multifd-channels"] = a.multifd
    if a.events:
        caps["events"] = True
    if a.zpd:
        params["zero-page-detection"] = a.zpd
    if a.postcopy is not None:
        caps["postcopy-ram"] = True
        scn["postcopy-after"] = a.postcopy
    if a.max_bandwidth is not None:
        params["max-bandwidth"] = a.max_bandwidth
    try:
        params.update(parse_args(a.set))
    except UsageError as e:
        ap.error(str(e))
    if a.verify:
        scn["verify"] = [p.split(":", 1) for p in a.verify]
    if a.uri != "tcp:127.0.0.1:0" or "uri" not in scn:
        scn["uri"] = a.uri
    scn.setdefault("timeout", a.timeout)
    scn["json"] = scn.get("json", False) or a.json
    if a.plot:
        scn["plot"] = a.plot
        require_matplotlib()

    try:
        return run(scn)
    except CannotConnect as e:
        print(f"qmig: {e}", file=sys.stderr)
        return 3
    except QMPError as e:
        print(f"qmig run: {e.desc}", file=sys.stderr)
        return 1
