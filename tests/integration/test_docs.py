#!/usr/bin/env python3
"""The README and docs/ say what is true: every page is reachable from the
README and every link and anchor resolves; every shell block marked
`<!-- doc-test: run -->` runs as written (with unique file names and ports)
and exits 0; in every other shell block each `qmigd` line uses options
that `qmigd SUBCOMMAND --help` lists and each `qmig SOCK COMMAND` line a
command that a qmigd or QEMU 10 monitor has (`qmig run` lines: options of
`qmig run --help`)."""
import glob
import os
import re
import shlex
import signal
import subprocess
import tempfile

from itest import test, main, check, Skip
from runner import Peer, QMIGD, free_port, unique_name, remove

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
QMIG = os.path.join(ROOT, "scripts", "qmig")
RUN_MARK = "<!-- doc-test: run -->"


def blocks(path):
    """(language, text, marked to run) of every fenced block."""
    out, lines = [], open(path).read().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if m:
            start = i + 1
            i += 1
            while i < len(lines) and lines[i] != "```":
                i += 1
            marked = start >= 2 and lines[start - 2].strip() == RUN_MARK
            out.append((m.group(1), "\n".join(lines[start:i]), marked))
        i += 1
    return out


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@test
def test_pages_linked_and_links_resolve():
    readme = open(PAGES[0]).read()
    for page in PAGES[1:]:
        rel = os.path.relpath(page, ROOT)
        check(f"]({rel})" in readme, f"{rel} is not linked from README.md")
    for page in PAGES:
        text = re.sub(r"```.*?```", "", open(page).read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            check(os.path.exists(full), f"{os.path.relpath(page, ROOT)}: {target} does not exist")
            if anchor and full.endswith(".md"):
                check(anchor in anchors(full),
                      f"{os.path.relpath(page, ROOT)}: no heading #{anchor} in {path or 'itself'}")


def uniquely_named(script, tag):
    """The block with its /tmp, /dev/shm and /var/tmp names and its ports
    made this run's own; returns the script and the paths to clean up."""
    names = {}

    def path(m):
        key = m.group(0)
        if key not in names:
            names[key] = f"{m.group(1)}/{tag}-{m.group(2)}"
        return names[key]

    script = re.sub(r"(/tmp|/dev/shm|/var/tmp)/([\w][\w.-]*)", path, script)
    for port in sorted(set(re.findall(r"127\.0\.0\.1:(\d{4,5})", script))):
        script = script.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}")
    return script, list(names.values())


def run_block(page, text):
    tag = unique_name("doc")
    script, paths = uniquely_named(text, tag)
    env = {**os.environ, "PATH": os.pathsep.join(
        [os.path.dirname(os.path.abspath(QMIGD)), os.path.dirname(QMIG), os.environ["PATH"]])}
    with tempfile.TemporaryDirectory(prefix="qmigd-doc-") as cwd:
        return run_script(page, script, ["bash", "-e", "-o", "pipefail", "-c", script], cwd, env,
                          paths)


def run_script(page, script, argv, cwd, env, paths):
    """Runs argv (a shell running script) in its own session; fails the test
    unless it exits 0 within 180 s; kills what it left running and removes
    paths. Returns its output."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        check(False, f"{page}: a block did not finish in 180 s:\n{script}\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running
        except ProcessLookupError:
            pass
        for p in paths:
            subprocess.run(["rm", "-rf", p])
    check(proc.returncode == 0,
          f"{page}: exit {proc.returncode} from\n{script}\n--- output ---\n{out[-3000:]}")
    return out


@test
def test_marked_blocks_run_as_written():
    ran = 0
    for page in PAGES:
        for lang, text, marked in blocks(page):
            if marked:
                check(lang == "sh", f"{page}: a marked block is not sh")
                out = run_block(os.path.relpath(page, ROOT), text)
                if "--verify" in text:
                    check(": identical" in out, out[-2000:])
                ran += 1
    check(ran >= 3, f"only {ran} runnable blocks")


@test
def test_readme_as_a_newcomer_runs_it():
    """After the README's two commands (install-deps, cmake build in
    build/), its runnable blocks, in order, exactly as written (their own
    /tmp and /dev/shm names, port 4444), from the clone's top in a new login
    shell with nothing of this test's environment."""
    built = os.path.join(ROOT, "build", "bin", "qmigd")
    if os.path.realpath(QMIGD) != os.path.realpath(built):
        raise Skip(f"the README's build is {built}; this run tests {QMIGD}", machine=True)
    script = "\n".join(text for lang, text, marked in blocks(PAGES[0]) if marked)
    paths = re.findall(r"(?:/tmp|/dev/shm)/[\w.-]+", script)
    env = {"HOME": os.environ.get("HOME", "/root"), "TERM": "dumb"}
    out = run_script("README.md", script,
                     ["env", "-i", *[f"{k}={v}" for k, v in env.items()],
                      "bash", "-l", "-e", "-o", "pipefail", "-c", script], ROOT, None,
                     sorted(set(paths)))
    check(out.count(": identical") == 2, out[-2000:])


def logical_lines(text):
    return [ln for ln in text.replace("\\\n", " ").split("\n")
            if ln.strip() and not ln.lstrip().startswith("#")]


def help_options(argv):
    r = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", r.stdout + r.stderr))


def monitor_commands():
    """What a qmigd of either role and a QEMU 10 answer to."""
    names = set()
    for kind, role in (("qmigd", "source"), ("qmigd", "dest"), ("qemu", "source")):
        img = f"/dev/shm/{unique_name('doc-cmds')}.ram"
        p = Peer(kind, role, [("mem", img, 1 << 20)], "doc-cmds")
        try:
            names |= {c["name"] for c in p.qmp.cmd("query-commands")}
        finally:
            p.stop()
            remove(img)
    return names


@test
def test_example_commands_exist():
    subs = {s: help_options([QMIGD, s]) for s in ("source", "dest", "guest", "limits")}
    run_opts = help_options([QMIG, "run"])
    commands = monitor_commands()
    seen = 0
    for page in PAGES:
        rel = os.path.relpath(page, ROOT)
        for lang, text, _ in blocks(page):
            if lang != "sh":
                continue
            for line in logical_lines(text):
                for part in re.split(r"&&|\|\||;|\|", line):
                    try:
                        words = shlex.split(part)
                    except ValueError:
                        continue
                    while words and (words[0] == "sudo" or "=" in words[0]):
                        words = words[1:]
                    if not words:
                        continue
                    prog = os.path.basename(words[0])
                    if prog == "qmigd" and len(words) > 1:
                        check(words[1] in subs, f"{rel}: qmigd {words[1]}?")
                        for w in words[2:]:
                            opt = w.split("=")[0]
                            if opt.startswith("--"):
                                check(opt in subs[words[1]], f"{rel}: qmigd {words[1]} {opt}?")
                        seen += 1
                    elif prog == "qmig" and len(words) > 1:
                        if words[1] == "run":
                            for w in words[2:]:
                                if w.startswith("--"):
                                    check(w.split("=")[0] in run_opts, f"{rel}: qmig run {w}?")
                        elif len(words) > 2 and words[2] not in ("hmp", "wait", "events"):
                            check(words[2] in commands, f"{rel}: no monitor has {words[2]}")
                        seen += 1
    check(seen >= 30, f"only {seen} qmigd/qmig lines checked")


if __name__ == "__main__":
    main()
