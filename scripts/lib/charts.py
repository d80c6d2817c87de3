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
