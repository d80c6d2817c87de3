#!/usr/bin/env python3
"""Side-by-side migration benchmark: the same RAM image migrated QEMU 10 ->
QEMU 10, qmigd -> qmigd, QEMU -> qmigd and qmigd -> QEMU, interleaved, on the
same machine, unlimited bandwidth. Reports medians of wall time (migrate until
both sides completed, by their MIGRATION event timestamps), CPU seconds of both processes, peak memory (RSS and
private/anonymous) of each, ratios to QEMU -> QEMU, and the share of this
machine's limits (`qmigd limits`) that qmigd -> qmigd reached.

  scripts/bench.py                       # one cell: a 4 GiB image, mixed, 4 channels
  scripts/bench.py --grid                # every cell of two grids (see --grid below)
  scripts/bench.py --content zero,random --channels 0,4 --zpd legacy,multifd
  scripts/bench.py --backing thp --size 2G --limits --out results.md --plot results.png
  scripts/bench.py --size 2G --content text,mixed --compression zlib,zstd
  scripts/bench.py --size 2G --content random,mixed --tls

Backings: shm (/dev/shm, 4 KiB pages), thp (a huge=always tmpfs it mounts),
hugetlbfs (it mounts one and sets vm.nr_hugepages, restoring both after).
Images are 4 GiB unless --size says otherwise (--grid: 4 GiB on shm, 2 GiB
on huge pages), made in the backing: have twice that free there.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from charts import (WHISKERS, bar_chart, require_matplotlib, runs_words, size_words,  # noqa: E402
                    spread)  # noqa: E402
from runner import Peer, make_image, migrate, files_equal, remove, unique_name, QMIGD  # noqa: E402
from backing import backing_dir, Unavailable  # noqa: E402
from qmp_args import parse_size  # noqa: E402

CELL_SIZE = {}  # cell -> image bytes (a grid mixes 4 GiB and 2 GiB cells)
HUGE_TOUCHED = {}  # cell -> bytes of the 2 MiB pages holding any non-zero byte
FAULT_PASSES = {}  # cell -> [`qmigd limits --fault-bytes` results], one a round (--limits)
HUGE_PAGE = 2 << 20
PAIRS = [("qemu", "qemu"), ("qmigd", "qmigd"), ("qemu", "qmigd"), ("qmigd", "qemu")]
NAMES = {"qemu": "QEMU", "qmigd": "qmigd"}
GRID_4K = dict(backing=["shm"], size="4G", content=["zero", "random", "mixed", "text"],
               channels=[0, 1, 2, 4, 8], zpd=["none", "legacy", "multifd"], compression=["none"])
GRID_HUGE = dict(backing=["thp", "hugetlbfs"], size="2G", content=["zero", "random", "mixed"],
                 channels=[4], zpd=["multifd"], compression=["none"])


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class MemorySampler:
    """Peak private (anonymous) memory of some processes, sampled every 20 ms;
    peak RSS comes from the kernel's VmHWM at the end."""

    def __init__(self, pids):
        self.pids, self.anon = pids, {p: 0 for p in pids}
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            for p in self.pids:
                try:
                    self.anon[p] = max(self.anon[p], status_kib(p, "RssAnon"))
                except OSError:
                    pass
            time.sleep(0.02)

    def finish(self):
        self.stop = True
        self.thread.join()
        return {p: (status_kib(p, "VmHWM"), self.anon[p]) for p in self.pids}


TLS_DIRS = {}  # --tls: {"server": dir, "client": dir}, made once per bench run


def tls_setup(src, dst):
    """tls-creds-x509 on both peers (object-add); returns the parameters."""
    for peer, end in ((src, "client"), (dst, "server")):
        peer.qmp.cmd("object-add", **{"qom-type": "tls-creds-x509", "id": "tls0",
                                      "dir": TLS_DIRS[end], "endpoint": end})
    return {"tls-creds": "tls0"}


def vmstat(key):
    with open("/proc/vmstat") as f:
        for line in f:
            name, value = line.split()
            if name == key:
                return int(value)
    return 0


def allocated_bytes(path):
    """What the image holds in memory or on disk (its allocated blocks)."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def one_run(pair, src_img, size, cell, verify, idle=0.0):
    """One migration, after `idle` seconds with nothing running (every run
    gets the same pause: memory freed and left idle is taken back by the
    host, and the next first touch pays to back it again); returns a dict
    of measurements."""
    backing, content, channels, zpd, compression = cell[:5]
    dst_img = os.path.join(os.path.dirname(src_img), unique_name("bench-dst") + ".ram")
    src = dst = None
    keep_logs = True  # until the run is known good: a failure keeps them
    try:
        time.sleep(idle)
        thp0 = vmstat("thp_file_alloc")
        src = Peer(pair[0], "source", [("mem", src_img, size)], "bench-src")
        dst = Peer(pair[1], "dest", [("mem", dst_img, size)], "bench-dst")
        pids = (src.proc.pid, dst.proc.pid)
        c0 = sum(cpu_seconds(p) for p in pids)
        mem = MemorySampler(pids)
        params = {"multifd-compression": compression} if compression != "none" else {}
        if TLS_DIRS:
            params.update(tls_setup(src, dst))
        info, _, secs = migrate(src, dst, channels > 0, max(channels, 1), zpd, events=True,
                                params=params)
        cpu = sum(cpu_seconds(p) for p in pids) - c0
        peaks = mem.finish()
        dst_image = allocated_bytes(dst_img)
        thp_allocs = vmstat("thp_file_alloc") - thp0
        ok = files_equal(src_img, dst_img) if verify else None
        keep_logs = ok is False
        return {"secs": secs, "cpu": cpu, "ok": ok, "downtime": info.get("downtime"),
                "normal": info["ram"]["normal"],
                "src_rss": peaks[pids[0]][0], "src_anon": peaks[pids[0]][1],
                "dst_rss": peaks[pids[1]][0], "dst_anon": peaks[pids[1]][1],
                "dst_image": dst_image, "thp_allocs": thp_allocs}
    finally:
        for p in (src, dst):
            if p:
                p.stop()
                if not keep_logs:
                    remove(p.log_path)
        remove(dst_img)


def huge_pages_touched(path):
    """Bytes of the image's 2 MiB pages that hold any non-zero byte: a huge
    page with one data page in it is allocated and cleared whole."""
    zero, buf, touched = bytes(HUGE_PAGE), bytearray(HUGE_PAGE), 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return touched
            data = buf if n == HUGE_PAGE else buf[:n]
            if data != zero[:n]:
                touched += HUGE_PAGE


SHORT_SECS = 2.0
DEFAULT_IDLE = 1.0  # seconds before each run (--idle)
SHOW_IDLE = False  # more than one --idle value: each names its cells


def is_short(per_pair):
    """A cell whose every run so far took under SHORT_SECS."""
    return all(r["secs"] < SHORT_SECS for runs in per_pair.values() for r in runs)


def measure_limits(directory):
    out = subprocess.run([QMIGD, "limits", "--dir", directory], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def fault_pass(directory, data_bytes, idle):
    """The destination's page allocation alone, for a stream carrying
    `data_bytes` of pages, after the same idle as the runs: the first touch
    of that much fresh memory, one thread per core. It grows with the size
    (a paravirtualised host backs only part of the guest's free memory), so
    it is measured beside each cell rather than once."""
    time.sleep(idle)
    out = subprocess.run([QMIGD, "limits", "--dir", directory, "--fault-bytes",
                          str(max(int(data_bytes), 1 << 20))],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def median(runs, key):
    return statistics.median(r[key] for r in runs)


def cells_of(args):
    for backing in args.backing:
        for content in args.content:
            for ch in args.channels:
                for zpd in args.zpd:
                    for comp in args.compression:
                        for idle in args.idle:
                            yield (backing, content, ch, zpd, comp, idle)


def run_backing(backing, size, args, results, limits):
    cells = [c for c in cells_of(args) if c[0] == backing]
    if not cells:
        return
    try:
        with backing_dir(backing, need=2 * size) as d:
            if args.limits:
                limits[backing] = measure_limits(d)
                print(f"limits on {backing}: {json.dumps(limits[backing])}", flush=True)
            for content in args.content:
                mine = [c for c in cells if c[1] == content]
                src_img = os.path.join(d, unique_name("bench-src") + ".ram")
                try:
                    make_image(src_img, size, content)
                    touched = huge_pages_touched(src_img) if backing != "shm" else None
                    # One untimed migration first: memory this VM has not used
                    # lately costs several times more on first touch, and the
                    # pair that ran first in a cell would pay for all.
                    if args.warmup:
                        one_run(("qmigd", "qmigd"), src_img, size, mine[0], False)
                    # Repeats outside: runs of a cell spread out. Short cells get
                    # --repeat-short runs at least: one sub-second run on a
                    # shared VM swings by 2x, and the next cell costs seconds.
                    for r in range(max(args.repeat, args.repeat_short)):
                        for cell in mine:
                            if r >= args.repeat and not is_short(results[cell]):
                                continue
                            # Interleaved, the order reversed every other round:
                            # the pair run second in a round can pay (or gain)
                            # for what the first left behind.
                            order = args.pairs if r % 2 == 0 else args.pairs[::-1]
                            for position, pair in enumerate(order):
                                run = one_run(pair, src_img, size, cell,
                                              args.verify == "all" or r == 0, cell[5])
                                run["position"] = position
                                results.setdefault(cell, {}).setdefault(pair, []).append(run)
                                CELL_SIZE[cell] = size
                                if touched is not None:
                                    HUGE_TOUCHED[cell] = touched
                                save_json(args.json, results, limits)
                                print(f"  {fmt_cell(cell)} run {r + 1} {NAMES[pair[0]]:>5} -> "
                                      f"{NAMES[pair[1]]:<5} {run['secs']:7.3f} s  cpu "
                                      f"{run['cpu']:7.3f} s  identical {run['ok']}", flush=True)
                                if run["ok"] is False:
                                    sys.exit(f"images differ: {cell} {pair}")
                            if args.limits and backing != "hugetlbfs":
                                data = run["normal"] * 4096  # the same stream for every pair
                                f = fault_pass(d, data, cell[5])
                                FAULT_PASSES.setdefault(cell, []).append(f)
                                save_json(args.json, results, limits)
                                print(f"  {fmt_cell(cell)} run {r + 1} fault pass "
                                      f"{data >> 20} MiB {f['fault_seconds']:7.3f} s  cpu "
                                      f"{f['fault_cpu_seconds']:7.3f} s", flush=True)
                finally:
                    remove(src_img)
    except Unavailable as why:
        print(f"skipping {backing}: {why}", flush=True)


def save_json(path, results, limits):
    """All runs so far (rewritten after every run: a grid cut short keeps
    what it measured; --from-json tables it)."""
    if not path:
        return
    with open(path + ".tmp", "w") as f:
        json.dump({"limits": limits, "runs": [
            {"cell": list(c), "pair": list(p), "size": CELL_SIZE.get(c),
             "huge_touched": HUGE_TOUCHED.get(c), "fault_passes": FAULT_PASSES.get(c),
             "runs": r}
            for c, per in results.items() for p, r in per.items()]}, f, indent=1)
    os.replace(path + ".tmp", path)


def fmt_cell(cell):
    backing, content, ch, zpd, comp, idle = cell
    return (f"{backing} {content} {'mf' + str(ch) if ch else 'plain'} {zpd}"
            + (f" {comp}" if comp != "none" else "") + (" tls" if TLS_DIRS else "")
            + (f" idle {idle:g}s" if SHOW_IDLE else ""))


def machine_bound(cell, runs, size, limits):
    """A lower bound on qmigd -> qmigd's time from this machine's limits:
    the page data must cross loopback TCP (wire time at the 4-stream rate),
    and on 2 cores the CPU work no migration can skip -- TCP's CPU per byte,
    the zero check of every page, and allocating each data page at the
    destination -- is shared by the cores. TCP's rate and CPU per byte are
    measured between buffers of the guest's memory larger than the cache, as
    a migration meets them (`tcp_loopback_gbps`, `tcp_cpu_s_per_gib`: the
    receive's copy into the page is in it). The allocation on a 4 KiB
    /dev/shm or a huge-page tmpfs (faulted in 4 KiB, as QEMU's mapping
    does) is the CPU of the cell's own fault passes (`qmigd limits
    --fault-bytes`: as much fresh memory as the stream's data, after the
    same idle, one thread per core; their median), since what it costs
    grows with the size on a paravirtualised host; without them, the
    warm-memory figures (`pwrite_gbps`, `fault_ns`). On hugetlbfs the pool's
    pages are backed: a fault that clears 2 MiB, `fault_ns` per 4 KiB of
    it, for every 2 MiB page that holds data (one data page in it is enough
    to allocate and clear it whole). Returns seconds, or None without
    limits."""
    lim = limits.get(cell[0])
    if not lim or lim.get("tcp_loopback_gbps", 0) <= 0 or cell[4] != "none" or TLS_DIRS:
        return None  # compressed or TLS: the bound is the cipher's or compressor's
    data = median(runs, "normal") * 4096
    wire = data / (lim["tcp_loopback_gbps"] * 1e9)
    if FAULT_PASSES.get(cell):
        store = statistics.median(f["fault_cpu_seconds"] for f in FAULT_PASSES[cell])
    elif cell[0] == "shm":
        store = data / (lim["pwrite_gbps"] * 1e9)
    elif cell[0] == "thp":  # each data page, faulted in 4 KiB
        store = data / 4096 * fault_ns(cell[0], lim) / 1e9
    else:  # every huge page with data in it, not only the data pages
        store = HUGE_TOUCHED.get(cell, data) / 4096 * fault_ns(cell[0], lim) / 1e9
    cpu = (data / (1 << 30) * lim["tcp_cpu_s_per_gib"] + size / (lim["zero_scan_gbps"] * 1e9)
           + store)
    return max(wire, cpu / lim.get("cores", 2))


def fault_ns(backing, lim):
    """What a destination's first write costs per 4 KiB. A hugetlbfs pool
    keeps its pages backed: the least of `qmigd limits`' passes. A huge-page
    tmpfs takes them from free memory, which a paravirtualised host may have
    to back again (free page reporting hands free blocks back within
    seconds; runs here are seconds apart): the first pass."""
    if backing == "thp" and lim.get("fault_fresh_ns_per_page", -1) > 0:
        return lim["fault_fresh_ns_per_page"]  # never below the least: it is one of the passes
    return lim["fault_ns_per_page"]


def limit_share(cell, runs, size, limits):
    """qmigd -> qmigd page data rate as a % of loopback TCP on this machine."""
    lim = limits.get(cell[0])
    if not lim or lim.get("tcp_loopback_gbps", 0) <= 0:
        return ""
    rate = median(runs, "normal") * 4096 / median(runs, "secs") / 1e9
    return f"{100 * rate / lim['tcp_loopback_gbps']:.0f}%"


def bound_text(cell, ours, size, limits):
    size = CELL_SIZE.get(cell, size)
    b = machine_bound(cell, ours, size, limits) if ours else None
    if not b:
        return ""
    passes = FAULT_PASSES.get(cell)
    faults = (f"; fault pass {statistics.median(f['fault_seconds'] for f in passes):.2f} s"
              if passes else "")
    return f"{b:.2f} ({median(ours, 'secs') / b:.2f}x{faults})"


def table(results, size, limits):
    head = ("| cell | QEMU→QEMU s (CPU s) | qmigd→qmigd s (CPU s) | ratio time / CPU "
            "| QEMU→qmigd s (ratio) | qmigd→QEMU s (ratio) | qmigd peak RSS / private MiB "
            "(src, dst) | data rate % of loopback TCP | machine bound s (qmigd / bound) |")
    lines = [head, "|" + "---|" * 9]
    for cell, per in results.items():
        base = per.get(("qemu", "qemu"))
        bt, bc = (median(base, "secs"), median(base, "cpu")) if base else (None, None)

        def cellfmt(pair, with_cpu=False):
            runs = per.get(pair)
            if not runs:
                return "—"
            t, c = median(runs, "secs"), median(runs, "cpu")
            s = f"{t:.2f} ({c:.2f})" if with_cpu else f"{t:.2f}"
            if bt and not with_cpu and pair != ("qemu", "qemu"):
                s += f" ({t / bt:.2f}x)"
            return s
        ours = per.get(("qmigd", "qmigd"))
        ratio = (f"{median(ours, 'secs') / bt:.2f}x / {median(ours, 'cpu') / bc:.2f}x"
                 if ours and bt else "—")
        mem = (f"{int(median(ours, 'src_rss')) >> 10} / {int(median(ours, 'src_anon')) >> 10}, "
               f"{int(median(ours, 'dst_rss')) >> 10} / {int(median(ours, 'dst_anon')) >> 10}"
               if ours else "—")
        lines.append(f"| {fmt_cell(cell)} | {cellfmt(('qemu', 'qemu'), True)} "
                     f"| {cellfmt(('qmigd', 'qmigd'), True)} | {ratio} "
                     f"| {cellfmt(('qemu', 'qmigd'))} | {cellfmt(('qmigd', 'qemu'))} | {mem} "
                     f"| {limit_share(cell, ours, size, limits) if ours else ''} "
                     f"| {bound_text(cell, ours, size, limits)} |")
    return "\n".join(lines)


def position_medians(runs):
    """Median time of the runs made first in their round and of those made
    later ("—" where there were none)."""
    out = []
    for first in (True, False):
        t = [r["secs"] for r in runs if "position" in r and (r["position"] == 0) == first]
        out.append(f"{statistics.median(t):.2f}" if t else "—")
    return " / ".join(out)


def memory_table(results):
    """Each side's time by its place in the round, and what the
    destination's image held afterwards (allocated MiB; 2 MiB pages the
    host allocated for files during the run, huge-page tmpfs)."""
    lines = ["| cell | QEMU→QEMU s, first / later in the round | qmigd→qmigd s, first / later "
             "| destination image MiB, QEMU / qmigd | huge pages allocated, QEMU / qmigd |",
             "|" + "---|" * 5]
    for cell, per in results.items():
        q, m = per.get(("qemu", "qemu"), []), per.get(("qmigd", "qmigd"), [])

        def med(runs, key, shift=0):
            vals = [r[key] for r in runs if key in r]
            return str(int(statistics.median(vals)) >> shift) if vals else "—"
        lines.append(f"| {fmt_cell(cell)} | {position_medians(q)} | {position_medians(m)} "
                     f"| {med(q, 'dst_image', 20)} / {med(m, 'dst_image', 20)} "
                     f"| {med(q, 'thp_allocs')} / {med(m, 'thp_allocs')} |")
    return "\n".join(lines)


BACKING_WORDS = {"shm": "/dev/shm", "thp": "huge-page tmpfs", "hugetlbfs": "hugetlbfs"}
CONTENT_WORDS = {"zero": "zero pages", "random": "random data", "mixed": "mixed pages",
                 "text": "text"}
ZPD_WORDS = {"none": "no zero-page check", "legacy": "zero check on the main thread",
             "multifd": "zero check on the channels"}


def cell_words(cell):
    """A cell as a chart labels it: "/dev/shm, zero pages, 4 channels"
    (the zero-page detection only where it is not multifd's own)."""
    backing, content, ch, zpd, comp, idle = cell
    parts = [BACKING_WORDS.get(backing, backing), CONTENT_WORDS.get(content, content),
             f"{ch} channel{'s' if ch != 1 else ''}" if ch else "no multifd"]
    if zpd != "multifd" or not ch:
        parts.append(ZPD_WORDS.get(zpd, zpd))
    if comp != "none":
        parts.append(f"{comp} compression")
    if TLS_DIRS:
        parts.append("TLS")
    if SHOW_IDLE:
        parts.append(f"{idle:g} s idle before")
    return ", ".join(parts)


def plot(results, path):
    cells = list(results)

    def per_pair(fn):
        return {f"{NAMES[a]} → {NAMES[b]}": [fn(results[c][(a, b)]) if results[c].get((a, b))
                                             else None for c in cells] for a, b in PAIRS}
    sizes = sorted({CELL_SIZE[c] for c in cells if CELL_SIZE.get(c)})
    counts = [len(r) for per in results.values() for r in per.values()] or [1]
    bar_chart(path, f"QEMU 10 vs qmigd migrating the same "
              f"{' and '.join(size_words(s) for s in sizes) or ''} image on the same machine, "
              f"{runs_words(counts)}",
              "wall time, s (lower is better)", [cell_words(c) for c in cells],
              per_pair(lambda r: median(r, "secs")),
              spreads=per_pair(lambda r: spread([x["secs"] for x in r])),
              cpu=("CPU time of both processes, s", per_pair(lambda r: median(r, "cpu")),
                   per_pair(lambda r: spread([x["cpu"] for x in r]))),
              note=WHISKERS if max(counts) > 1 else None)


def main():
    global SHOW_IDLE
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", action="store_true", help="every cell of two grids: shm 4G x content zero,random,mixed,text x "
                    "channels 0,1,2,4,8 x zpd none,legacy,multifd; thp,hugetlbfs 2G x "
                    "zero,random,mixed x 4 channels (overrides the cell options below)")
    ap.add_argument("--backing", default="shm", help="shm,thp,hugetlbfs (comma list; default %(default)s)")
    ap.add_argument("--size", default="4G",
                    help="image size, QEMU's syntax (default %(default)s: 4 GiB per image)")
    ap.add_argument("--content", default="mixed", help="zero,random,mixed,text (comma list; default %(default)s)")
    ap.add_argument("--channels", default="4", help="multifd channels, comma list; 0 = multifd off (default %(default)s)")
    ap.add_argument("--zpd", default="multifd", help="zero-page-detection: none,legacy,multifd (default %(default)s)")
    ap.add_argument("--compression", default="none", help="multifd-compression: none,zlib,zstd (default %(default)s)")
    ap.add_argument("--tls", action="store_true",
                    help="every run over TLS (certificates made with certtool; default off)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell and pair (default %(default)s)")
    ap.add_argument("--repeat-short", type=int, default=3,
                    help=f"runs at least, for a cell whose runs all took under {SHORT_SECS:.0f} s "
                    "(default %(default)s)")
    ap.add_argument("--pairs", default="qemu:qemu,qmigd:qmigd,qemu:qmigd,qmigd:qemu",
                    help="source:destination pairs, interleaved (default %(default)s)")
    ap.add_argument("--verify", choices=["first", "all"], default="first",
                    help="compare images after the first repeat only, or after every run "
                    "(default %(default)s)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="one untimed qmigd -> qmigd run per image first (0: none; default "
                    "%(default)s)")
    ap.add_argument("--idle", default=str(DEFAULT_IDLE),
                    help="seconds with nothing running before every run, the same for all; a "
                    "comma list makes a cell of each (default %(default)s; a long one, e.g. "
                    "1,8, measures a host that waited for the migration: memory it must back "
                    "again)")
    ap.add_argument("--limits", action="store_true", help="measure this machine's limits (default off)")
    ap.add_argument("--out", help="write the markdown table here (default: print only)")
    ap.add_argument("--json", help="write all runs here (default: none)")
    ap.add_argument("--plot", help="write a PNG chart here (default: none)")
    ap.add_argument("--from-json", help="only print the table (and --plot the chart) of an "
                    "earlier --json file (default: measure)")
    args = ap.parse_args()
    if args.plot:
        require_matplotlib()  # now, not after the whole run
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        results = {}
        for r in saved["runs"]:
            cell = tuple(r["cell"]) + ("none",) * (5 - len(r["cell"]))  # older files: no compression
            cell += (DEFAULT_IDLE,) * (6 - len(cell))  # nor idle
            results.setdefault(cell, {})[tuple(r["pair"])] = r["runs"]
            CELL_SIZE[cell] = r.get("size") or parse_size(
                GRID_4K["size"] if cell[0] == "shm" else GRID_HUGE["size"])
            if r.get("huge_touched") is not None:
                HUGE_TOUCHED[cell] = r["huge_touched"]
            if r.get("fault_passes"):
                FAULT_PASSES[cell] = r["fault_passes"]
        SHOW_IDLE = len({c[5] for c in results}) > 1
        print(table(results, 0, saved["limits"]))
        print("\n" + memory_table(results))
        if args.plot:
            plot(results, args.plot)
        return
    args.pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    args.idle = [float(x) for x in args.idle.split(",")]
    SHOW_IDLE = len(args.idle) > 1
    if args.tls:
        import tempfile
        import tls_certs
        root = tempfile.mkdtemp(prefix="qmigd-bench-tls-")
        ca = tls_certs.CA(root)
        TLS_DIRS["server"] = ca.issue(f"{root}/server", "server", "localhost")
        TLS_DIRS["client"] = ca.issue(f"{root}/client", "client", "bench client")
        import atexit
        import shutil
        atexit.register(shutil.rmtree, root, True)
    groups = []
    if args.grid:
        groups = [GRID_HUGE, GRID_4K]  # the short part first: a grid cut short has both
    else:
        groups = [dict(backing=args.backing.split(","), size=args.size,
                       content=args.content.split(","),
                       channels=[int(c) for c in args.channels.split(",")],
                       zpd=args.zpd.split(","), compression=args.compression.split(","))]
    results, limits = {}, {}
    for g in groups:
        for k, v in g.items():
            setattr(args, k, v)
        size = parse_size(args.size)
        print(f"{args.size} images ({size_words(size)} each, two per run: have "
              f"{size_words(2 * size)} free), {args.repeat} runs each ({args.repeat_short} if under "
              f"{SHORT_SECS:.0f} s), pairs interleaved in an order reversed every other round, "
              f"{' or '.join(f'{i:g}' for i in args.idle)} s idle before each run", flush=True)
        for backing in args.backing:
            run_backing(backing, size, args, results, limits)
    text = table(results, size, limits) + "\n\n" + memory_table(results)
    if limits:
        text += "\n\nMachine limits (`qmigd limits`):\n\n```\n" + json.dumps(limits, indent=1) + "\n```\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    save_json(args.json, results, limits)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
