"""Bar charts of the benchmarks' tables (python3-matplotlib), so that QEMU
against qmigd reads at a glance: one group of bars per table row, one bar
per series, the value written on each bar."""


def fmt3(v):
    """The charts' one precision rule: 3 significant digits (1.30, 0.550,
    21.1), whole numbers from 1000 on (no exponents)."""
    if abs(v) >= 1000:
        return f"{v:.0f}"
    return f"{v:#.3g}".rstrip(".")


def machine():
    """This machine in words: its hostname and CPU model (/proc/cpuinfo)
    and how many CPUs it has, for a chart's note."""
    import os
    import socket
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = " ".join(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return f"{socket.gethostname()}: {model}, {os.cpu_count()} CPUs"


def size_words(nbytes):
    """4294967296 -> "4 GiB", 67108864 -> "64 MiB" (3 significant digits)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} bytes"


def runs_words(counts):
    """What the bars are, from the runs per bar: "one run", "median of 3
    runs", "median of 1-3 runs"; and whether the chart has whiskers."""
    lo, hi = min(counts), max(counts)
    if hi == 1:
        return "one run"
    return f"median of {lo}-{hi} runs" if lo != hi else f"median of {hi} runs"


WHISKERS = "bars: medians, whiskers: the fastest and slowest run"


def spread(values):
    """(min, max) of a cell's repeats, for whiskers; None for one run."""
    return (min(values), max(values)) if len(values) > 1 else None


def _bars(ax, groups, series, spreads, ylabel, log):
    import textwrap
    names = [n for n, vs in series.items() if any(v is not None for v in vs)]
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for i, v in enumerate(series[name]):
            if v is not None:
                xs.append(i + (k - (len(names) - 1) / 2) * width)
                ys.append(v)
                mm = (spreads or {}).get(name, [None] * len(groups))[i]
                lo.append(v - mm[0] if mm else 0)
                hi.append(mm[1] - v if mm else 0)
        err = [lo, hi] if any(lo) or any(hi) else None
        bars = ax.bar(xs, ys, width, label=name, yerr=err, capsize=3 if err else 0,
                      error_kw={"elinewidth": 0.8, "alpha": 0.7})
        ax.bar_label(bars, labels=[fmt3(y) for y in ys], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([textwrap.fill(g, 24) for g in groups], fontsize=8)
    ax.set_ylabel(ylabel, fontsize=9)
    values = [v for vs in series.values() for v in vs if v]
    if log is None:
        log = bool(values) and max(values) > 20 * min(values)
    if log:
        ax.set_yscale("log")
    # Room above the tallest bar for its label and the legend.
    top = max(values, default=1)
    ax.set_ylim(top=top * (3 if log else 1.3))
    ax.legend(fontsize=8, loc="upper left" if log else "best")
    ax.grid(axis="y", which="both", alpha=0.3)


def bar_chart(path, title, ylabel, groups, series, log=None, note=None, spreads=None,
              cpu=None):
    """groups: the x labels, in words; series: {name: [value or None per
    group]}; spreads: {name: [(min, max) or None per group]}, drawn as
    whiskers (the repeats' range). cpu: (ylabel, series, spreads) of the
    CPU time the script measured, drawn in a panel below with the same
    groups. log: a logarithmic axis; None: only where the values span more
    than 20x (a linear one shows ratios as they are). The note (with this
    machine's name and CPU added) goes under the chart; a long title wraps.
    Writes a PNG at path."""
    import sys
    import textwrap
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"--plot needs matplotlib, which {sys.executable} lacks: Debian's "
                 "python3-matplotlib (scripts/install-deps.sh) serves /usr/bin/python3")
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    shown = sum(1 for vs in series.values() if any(v is not None for v in vs))
    width_in = max(7.0, 1.1 * len(groups) * max(1, shown) * 0.6 + 3)
    panels = 2 if cpu else 1
    fig, axes = plt.subplots(panels, 1, figsize=(width_in, 4.8 + 3.2 * (panels - 1)),
                             squeeze=False, sharex=True)
    _bars(axes[0][0], groups, series, spreads, ylabel, log)
    if cpu:
        _bars(axes[1][0], groups, cpu[1], cpu[2], cpu[0], log)
    # ~ 11 characters per inch at 10 points: the title stays on the image.
    fig.suptitle(textwrap.fill(title, max(40, int(width_in * 11))), fontsize=10)
    lines = [ln for ln in (note, machine()) if ln]
    note_text = "\n".join(textwrap.fill(ln, max(60, int(width_in * 17))) for ln in lines)
    fig.text(0.01, 0.005, note_text, fontsize=7, alpha=0.7, va="bottom")
    # A 7-point line is ~0.12 inch high.
    bottom = 0.12 * (note_text.count("\n") + 1) / fig.get_figheight() + 0.01
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def require_matplotlib():
    """Call before a long run whose end is a chart: a python3 without
    matplotlib (a pyenv's, a venv's) hands the whole command to Debian's
    /usr/bin/python3 when that one has it, else stops now, saying why."""
    import os
    import subprocess
    import sys
    try:
        import matplotlib  # noqa: F401
        return
    except ImportError:
        pass
    system = "/usr/bin/python3"
    if os.path.realpath(sys.executable) != os.path.realpath(system) and os.path.exists(system) \
            and subprocess.run([system, "-c", "import matplotlib"],
                               capture_output=True).returncode == 0:
        os.execv(system, [system] + sys.argv)
    sys.exit(f"--plot needs matplotlib, which {sys.executable} lacks: apt install "
             "python3-matplotlib (scripts/install-deps.sh does) and run with /usr/bin/python3")


def timeline_chart(path, title, samples, final):
    """A migration over time (samples of timeline.Timeline): remaining
    RAM, throughput and the dirty-page rate, one panel each over a shared
    time axis; each dirty sync a dotted line, the switchover (with the
    downtime) and postcopy's start marked, postcopy's page requests on the
    last panel. Writes a PNG at path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from timeline import SWITCHOVER

    MiB = 1 << 20
    ts = [s["t"] for s in samples]
    fig, (ax_rem, ax_bw, ax_dirty) = plt.subplots(3, 1, sharex=True, figsize=(9, 7.2))
    # In setup nothing is counted yet: no point rather than a false zero.
    ax_rem.plot(ts, [s["remaining"] / MiB if s["status"] != "setup" and "remaining" in s
                     else float("nan") for s in samples], color="tab:blue")
    ax_rem.set_ylabel("remaining (MiB)")
    # Throughput from the transferred counter between samples.
    bw_t, bw = [], []
    for a, b in zip(samples, samples[1:]):
        if b["t"] > a["t"] and "transferred" in a and "transferred" in b:
            bw_t.append(b["t"])
            bw.append((b["transferred"] - a["transferred"]) / MiB / (b["t"] - a["t"]))
    ax_bw.plot(bw_t, bw, color="tab:green")
    ax_bw.set_ylabel("throughput (MiB/s)")
    ax_dirty.plot(ts, [s.get("dirty-pages-rate", 0) for s in samples], color="tab:red",
                  label="dirty pages/s")
    ax_dirty.set_ylabel("dirty rate (pages/s)")
    ax_dirty.set_xlabel("seconds since the first sample")
    if any(s.get("postcopy-requests") for s in samples):
        req = ax_dirty.twinx()
        req.step(ts, [s.get("postcopy-requests", 0) for s in samples], color="tab:purple",
                 where="post", label="postcopy requests")
        req.set_ylabel("postcopy requests", color="tab:purple")
    # Each dirty sync: where the counter moved.
    syncs = [b["t"] for a, b in zip(samples, samples[1:])
             if b.get("dirty-sync-count", 0) > a.get("dirty-sync-count", 0)]
    for ax in (ax_rem, ax_bw, ax_dirty):
        for t in syncs:
            ax.axvline(t, color="gray", linestyle=":", linewidth=0.8)
        ax.grid(alpha=0.3)
    marks = []
    post = next((s["t"] for s in samples if s["status"] == "postcopy-active"), None)
    if post is not None:
        marks.append((post, "postcopy", "tab:purple"))
    switch = next((s["t"] for s in samples if s["status"] in SWITCHOVER), None)
    if switch is not None and switch != post:
        down = final.get("downtime")
        marks.append((switch, "switchover" + (f" ({down} ms down)" if down is not None else ""),
                      "black"))
    for t, label, color in marks:
        for ax in (ax_rem, ax_bw, ax_dirty):
            ax.axvline(t, color=color, linewidth=1.2)
        ax_rem.annotate(label, (t, 1), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=8, color=color)
    ram = final.get("ram", {})
    sub = (f"{final.get('status', '?')}: {ram.get('total', 0) / MiB:.0f} MiB of RAM, "
           f"{ram.get('transferred', 0) / MiB:.0f} MiB sent, {ram.get('dirty-sync-count', 0)} "
           f"dirty syncs, total {final.get('total-time', '?')} ms")
    fig.suptitle(f"{title}\n{sub}", fontsize=10)
    fig.text(0.01, 0.005, "dotted: a dirty sync", fontsize=7, alpha=0.7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
