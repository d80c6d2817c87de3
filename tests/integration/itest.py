"""A tiny test runner for the integration tests (standard library only).

Each test is a function registered with @test; the runner runs them in
order (optionally filtered by -k), prints one line per test and closes
with "N passed, N failed". Exit status 1 if anything failed.
"""
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "lib"))

_tests = []
_cleanups = []


def test(fn):
    _tests.append(fn)
    return fn


def cleanup(fn):
    """Registers what a test file's tests share and leave behind (a work
    directory, a daemon pair) to be removed once the run ends, however it
    ends and whichever tests -k picked."""
    _cleanups.append(fn)
    return fn


class Skip(Exception):
    """Raised by a test that cannot run here; the message says why.
    `machine` says the cause is the machine itself (no root, a kernel
    without hugetlbfs or namespaces, another build under test), which no
    install can change."""

    def __init__(self, why, machine=False):
        super().__init__(why)
        self.machine = machine


def skip(why, machine=False):
    """Skips the running test. Under CI (CI=true) a skip whose cause
    scripts/install-deps.sh should have removed (a missing tool, package
    or guest kernel: machine=False) fails the test instead: a CI run that
    passes has run what it claims. machine=True marks what only another
    machine would change."""
    raise Skip(why, machine)


def check(cond, msg="check failed"):
    if not cond:
        raise AssertionError(msg)


def run_ok(argv, timeout=300, **kw):
    """Runs a command that must succeed; returns its stdout, or fails the
    test with its exit status and the ends of its output."""
    import subprocess
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    check(r.returncode == 0, f"{argv}: {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def clear_logs():
    """Empties this test's log directory (QMIGD_LOG_DIR, set by ctest) of
    an earlier run's logs, so that what it holds after a run is that run's."""
    d = os.environ.get("QMIGD_LOG_DIR")
    if d and os.path.isdir(d):
        for name in os.listdir(d):
            if name.endswith((".log", ".serial")) or name == "loop-gaps.txt":
                os.unlink(os.path.join(d, name))


def main():
    clear_logs()
    args = sys.argv[1:]
    pattern = args[args.index("-k") + 1] if "-k" in args else ""
    passed = failed = skipped = 0
    try:
        passed, failed, skipped = _run(pattern)
    finally:
        for fn in reversed(_cleanups):
            fn()
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""),
          flush=True)
    sys.exit(1 if failed or not (passed or skipped) else 0)


def _run(pattern):
    passed = failed = skipped = 0
    for fn in _tests:
        if pattern not in fn.__name__:
            continue
        t0 = time.monotonic()
        try:
            fn()
            passed += 1
            print(f"PASS {fn.__name__} ({time.monotonic() - t0:.1f}s)", flush=True)
        except Skip as why:
            if os.environ.get("CI") == "true" and not why.machine:
                failed += 1
                print(f"FAIL {fn.__name__}: skipped under CI, and install-deps.sh "
                      f"should provide what it lacks: {why}", flush=True)
                continue
            skipped += 1
            print(f"SKIP {fn.__name__}: {why}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {fn.__name__} ({time.monotonic() - t0:.1f}s)", flush=True)
            traceback.print_exc()
    return passed, failed, skipped
