"""Guest RAM backings for tests and benchmarks: /dev/shm (4 KiB pages), a
huge-page tmpfs, or hugetlbfs. Mounts what it needs as root and undoes it
all afterwards (the mount, and vm.nr_hugepages back to what it was).

    with backing_dir("hugetlbfs", need=1 << 30) as d:
        ...  # images under d
"""
import contextlib
import os
import subprocess
import tempfile

KINDS = ("shm", "thp", "hugetlbfs")
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"
HUGE = 2 << 20


class Unavailable(Exception):
    """This machine cannot give that backing (not root, no huge pages...)."""


def _mount(fstype, options, where):
    r = subprocess.run(["mount", "-t", fstype, "-o", options, "none", where],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise Unavailable(f"cannot mount {fstype} ({options}): {r.stderr.strip()}")


def _free_hugepages():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1])
    return 0


@contextlib.contextmanager
def backing_dir(kind, need=0):
    """Yields a directory on `kind` with room for `need` bytes of images."""
    if kind == "shm":
        yield "/dev/shm"
        return
    if os.geteuid() != 0:
        raise Unavailable(f"{kind} needs root to mount")
    where = tempfile.mkdtemp(prefix=f"qmigd-{kind}-")
    old_nr = None
    mounted = False
    try:
        if kind == "thp":
            size_mb = max(64, need >> 20) + 64
            _mount("tmpfs", f"huge=always,size={size_mb}M", where)
        elif kind == "hugetlbfs":
            with open(NR_HUGEPAGES) as f:
                old_nr = int(f.read())
            want = (need + HUGE - 1) // HUGE + 16  # + scratch for page-path calibration
            with open(NR_HUGEPAGES, "w") as f:
                f.write(str(old_nr + want))
            if _free_hugepages() < want:
                raise Unavailable(f"could reserve only {_free_hugepages()} of {want} huge pages")
            _mount("hugetlbfs", "pagesize=2M", where)
        else:
            raise ValueError(kind)
        mounted = True
        yield where
    finally:
        if mounted:
            for name in os.listdir(where):
                os.unlink(os.path.join(where, name))
            subprocess.run(["umount", where], check=False)
        os.rmdir(where)
        if old_nr is not None:
            with open(NR_HUGEPAGES, "w") as f:
                f.write(str(old_nr))
