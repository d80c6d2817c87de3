"""Bar charts of the benchmarks' tables (python3-matplotlib), so that QEMU
against qmigd reads at a glance: one group of bars per table row, one bar
per series, the value written on each bar."""


def bar_chart(path, title, ylabel, groups, series, log=None, note=None):
    """groups: the x labels; series: {name: [value or None per group]}.
    log: a logarithmic axis; None: only where the values span more than
    20x (a linear one shows ratios as they are). Writes a PNG at path."""
    import sys
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"--plot needs matplotlib, which {sys.executable} lacks: Debian's "
                 "python3-matplotlib (scripts/install-deps.sh) serves /usr/bin/python3")
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    names = list(series)
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(groups) * max(1, len(names)) * 0.6 + 3),
                                    4.8))
    for k, name in enumerate(names):
        xs, ys = [], []
        for i, v in enumerate(series[name]):
            if v is not None:
                xs.append(i + (k - (len(names) - 1) / 2) * width)
                ys.append(v)
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, labels=[f"{y:.3g}" for y in ys], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)))
    long_labels = max((len(g) for g in groups), default=0) > 14
    ax.set_xticklabels(groups, rotation=30 if long_labels else 0,
                       ha="right" if long_labels else "center", fontsize=8)
    ax.set_ylabel(ylabel)
    values = [v for vs in series.values() for v in vs if v]
    if log is None:
        log = bool(values) and max(values) > 20 * min(values)
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, alpha=0.7)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
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
