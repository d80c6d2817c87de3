#!/usr/bin/env python3
"""The benchmarks draw their tables: scripts/bench.py, bench_file.py and
bench_park.py run small and with --plot write a PNG of the figures they
print (python3-matplotlib, Debian's, for /usr/bin/python3); bench.py
--from-json redraws a saved run. The charts the docs show are PNGs that
exist."""
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile

from itest import test, main, check, skip, run_ok
from runner import QMIGD

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(ROOT, "scripts")
PYTHON = "/usr/bin/python3"


def need_matplotlib():
    if not os.path.exists(PYTHON) or subprocess.run(
            [PYTHON, "-c", "import matplotlib"], capture_output=True).returncode != 0:
        skip("python3-matplotlib is not installed (scripts/install-deps.sh installs it)")


def png_size(path):
    """(width, height) from the PNG's IHDR, or fails."""
    with open(path, "rb") as f:
        head = f.read(24)
    check(head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG")
    return struct.unpack(">II", head[16:24])


def run_bench(argv, timeout=600):
    return run_ok([PYTHON] + argv, timeout, env={**os.environ, "QMIGD": os.path.abspath(QMIGD)})


@test
def test_bench_plots_what_it_prints_and_redraws_from_json():
    need_matplotlib()
    with tempfile.TemporaryDirectory(prefix="qmigd-plot-") as d:
        png, js = os.path.join(d, "bench.png"), os.path.join(d, "bench.json")
        out = run_bench([os.path.join(SCRIPTS, "bench.py"), "--size", "64M", "--content",
                         "mixed", "--channels", "4", "--repeat", "2", "--repeat-short", "2",
                         "--warmup", "0", "--idle", "0", "--pairs", "qemu:qemu,qmigd:qmigd",
                         "--plot", png, "--json", js])
        check("| shm mixed mf4 multifd |" in out, out)
        check("destination image MiB" in out, out)
        w, h = png_size(png)
        check(w >= 600 and h >= 400, (w, h))
        with open(js) as f:
            runs = json.load(f)["runs"]
        check(len(runs) == 2, f"{len(runs)} cells x pairs saved")
        # The order is reversed every other round: each pair ran first once
        # and second once.
        for r in runs:
            check(sorted(x["position"] for x in r["runs"]) == [0, 1], r)
            check(all(x["dst_image"] >= 0 and "thp_allocs" in x for x in r["runs"]), r)
        again = os.path.join(d, "again.png")
        out = run_bench([os.path.join(SCRIPTS, "bench.py"), "--from-json", js, "--plot", again])
        check("| shm mixed mf4 multifd |" in out and png_size(again) == (w, h), out)


@test
def test_bench_file_plots_save_and_restore():
    need_matplotlib()
    with tempfile.TemporaryDirectory(prefix="qmigd-plot-") as d:
        png = os.path.join(d, "file.png")
        out = run_bench([os.path.join(SCRIPTS, "bench_file.py"), "--dir", d, "--size", "64M",
                         "--repeat", "1", "--plot", png])
        check(re.search(r"\| save s .*\| restore s", out, re.S), out)
        png_size(png)


@test
def test_bench_park_plots_a_small_guest():
    need_matplotlib()
    if not glob.glob("/boot/vmlinuz-*") or not shutil.which("busybox"):
        skip("no kernel or busybox-static for the guest (scripts/install-deps.sh installs them)")
    with tempfile.TemporaryDirectory(prefix="qmigd-plot-") as d:
        png = os.path.join(d, "park.png")
        out = run_bench([os.path.join(SCRIPTS, "bench_park.py"), "--mem", "256M", "--fill", "16",
                         "--repeat", "1", "--channels", "2", "--plot", png], timeout=900)
        check("| QEMU -> qmigd (park) |" in out, out)
        png_size(png)


@test
def test_charts_in_the_docs_exist():
    shown = 0
    for page in [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md")):
        with open(page) as f:
            for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", f.read()):
                png_size(os.path.normpath(os.path.join(os.path.dirname(page), target)))
                shown += 1
    check(shown >= 3, f"only {shown} charts shown")


@test
def test_bench_help_says_its_defaults():
    """bench.py --help: how big its images are and every option's default,
    in words a newcomer reads (no issue tracker's vocabulary)."""
    out = run_ok([PYTHON, os.path.join(SCRIPTS, "bench.py"), "--help"], 60)
    check("4 GiB" in out and "issue" not in out, out)
    opts = out.split("options:", 1)[1]
    blocks = re.split(r"\n  (?=-)", opts)
    for b in filter(str.strip, blocks):
        name = b.split()[0]
        if name not in ("-h,", "--grid", "--from-json"):
            check("default" in b, f"bench.py --help gives no default for {name}: {b}")


@test
def test_migration_timeline_chart():
    """qmig run --plot: a live migration (a guest dirtying a hot set while
    it moves) drawn as a timeline, its samples beside it with the dirty
    syncs and the switchover the chart marks. qmig is run by the python3
    on the PATH, which hands itself to /usr/bin/python3 when it lacks
    matplotlib."""
    need_matplotlib()
    qmig = os.path.join(SCRIPTS, "qmig")
    with tempfile.TemporaryDirectory(prefix="qmigd-timeline-") as d:
        scn = {"source": {"launch": "qmigd", "ram": [{"name": "mem", "path": f"/dev/shm/{os.path.basename(d)}-s.ram", "size": "128M", "content": "mixed"}]},
               "destination": {"launch": "qmigd", "ram": [{"name": "mem", "path": f"/dev/shm/{os.path.basename(d)}-d.ram", "size": "128M"}]},
               "capabilities": {"multifd": True},
               "parameters": {"multifd-channels": 2, "max-bandwidth": 64 << 20},
               "guest": {"rate": 4000, "pattern": "hot", "hot-set": "16M"}, "timeout": 60}
        with open(os.path.join(d, "scn.json"), "w") as f:
            json.dump(scn, f)
        png = os.path.join(d, "run.png")
        out = run_ok([qmig, "run", os.path.join(d, "scn.json"), "--plot", png], 120,
                     env={**os.environ, "QMIGD": os.path.abspath(QMIGD)})
        check("status=completed" in out, out)
        w, h = png_size(png)
        check(w >= 800 and h >= 600, (w, h))
        with open(os.path.join(d, "run.json")) as f:
            tl = json.load(f)
        statuses = [s["status"] for s in tl["samples"]]
        check("active" in statuses and statuses[-1] == "completed", statuses)
        check(tl["samples"][-1]["dirty-sync-count"] >= 2, tl["samples"][-1])
        check(tl["final"]["downtime"] >= 0 and "->" in tl["title"], tl["final"])


if __name__ == "__main__":
    main()
