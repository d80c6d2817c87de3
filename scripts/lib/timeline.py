"""A migration's timeline, from the query-migrate answers a run polls:
what an operator looks at when a guest does not converge. `qmig run --plot
FILE.png` and `qmig SOCK migrate --wait --plot FILE.png` write the chart
and the samples beside it (FILE.json)."""
import json
import os
import time

# query-migrate's RAM counters kept per sample (QEMU 10's names).
RAM_FIELDS = ("transferred", "remaining", "total", "dirty-pages-rate", "dirty-sync-count",
              "postcopy-requests", "mbps", "normal", "duplicate", "page-size")
SWITCHOVER = ("pre-switchover", "device", "completed", "postcopy-active", "postcopy-paused",
              "postcopy-recover", "postcopy-recover-setup")


def json_path(png_path):
    return (png_path[:-4] if png_path.endswith(".png") else png_path) + ".json"


def unwritable(png_path):
    """Why FILE.png or its FILE.json cannot be written, or None: asked before
    a migration starts, so that a chart's path never turns a completed
    migration into a failed command."""
    for path in (png_path, json_path(png_path)):
        d = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(d):
            return f"{path}: no directory {d}"
        if os.path.isdir(path):
            return f"{path} is a directory"
        if not os.access(path if os.path.exists(path) else d, os.W_OK):
            return f"{path}: not writable"
    return None


class Timeline:
    """Samples of one migration: seconds since the first, status, RAM counters."""

    def __init__(self, title=""):
        self.t0 = None
        self.title = title
        self.samples = []
        self.final = {}

    def record(self, info):
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        ram = info.get("ram", {})
        self.samples.append({"t": round(now - self.t0, 4), "status": info.get("status"),
                             **{k: ram[k] for k in RAM_FIELDS if k in ram}})
        self.final = info

    def save(self, png_path):
        """FILE.png and FILE.json (the samples and the last answer)."""
        with open(json_path(png_path), "w") as f:
            json.dump({"title": self.title, "samples": self.samples, "final": self.final}, f,
                      indent=1)
        from charts import timeline_chart
        timeline_chart(png_path, self.title, self.samples, self.final)
        return json_path(png_path)

    def report(self, png_path):
        """save(), in the words of a line for the user: a chart that could
        not be written after all is said, not raised (the migration's own
        result is the command's)."""
        try:
            return f"timeline: {png_path} (samples: {self.save(png_path)})"
        except (OSError, ValueError) as e:
            return f"timeline not written: {e}"
