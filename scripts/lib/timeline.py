"""A migration's timeline, from the query-migrate answers a run polls:
what an operator looks at when a guest does not converge. `qmig run --plot
FILE.png` and `qmig SOCK migrate --wait --plot FILE.png` write the chart
and the samples beside it (FILE.json)."""
import json
import time

# query-migrate's RAM counters kept per sample (QEMU 10's names).
RAM_FIELDS = ("transferred", "remaining", "total", "dirty-pages-rate", "dirty-sync-count",
              "postcopy-requests", "mbps", "normal", "duplicate", "page-size")
SWITCHOVER = ("pre-switchover", "device", "completed", "postcopy-active", "postcopy-paused",
              "postcopy-recover", "postcopy-recover-setup")


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
        base = png_path[:-4] if png_path.endswith(".png") else png_path
        with open(base + ".json", "w") as f:
            json.dump({"title": self.title, "samples": self.samples, "final": self.final}, f,
                      indent=1)
        from charts import timeline_chart
        timeline_chart(png_path, self.title, self.samples, self.final)
        return base + ".json"
