#!/usr/bin/env bash
# clang's thread-safety analysis (daemon/thread_safety.h) over every
# translation unit of a build tree, as errors: `scripts/thread-safety.sh
# [BUILD_DIR]` (default build/; CMake writes its compile_commands.json).
# Each unit is parsed by clang++ -fsyntax-only with the build's own flags,
# so a gcc tree is checked without a second build (a fraction of a clang
# build's time). Exit status 1, with clang's diagnostics, if any access
# breaks an annotation.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
db="$dir/compile_commands.json"
[ -e "$db" ] || { echo "thread-safety: no $db (configure $dir first)" >&2; exit 1; }
command -v clang++ >/dev/null || { echo "thread-safety: clang++ is not installed" >&2; exit 1; }
exec python3 - "$db" "$(nproc)" "$dir/thread-safety.log" <<'PY'
import concurrent.futures, json, shlex, subprocess, sys

db, jobs, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# gcc's flags that clang has no use for: outputs, dependency files and the
# precompiled header (clang parses the header itself).
DROP_WITH_ARG = {"-o", "-MF", "-MT", "-MQ"}
DROP = {"-MD", "-MMD", "-c", "-Winvalid-pch"}
CHECK = ["-fsyntax-only", "-Wno-unknown-warning-option", "-Wno-unused-command-line-argument",
         "-Wthread-safety", "-Werror=thread-safety"]


def clang_argv(entry):
    argv = entry.get("arguments") or shlex.split(entry["command"])
    out, it = ["clang++"], iter(argv[1:])
    for a in it:
        if a in DROP_WITH_ARG:
            next(it, None)
        elif a == "-include":
            out += ["-include", plain_header(next(it))]
        elif a not in DROP and not a.startswith("-fpch"):
            out.append(a)
    return out + CHECK


def plain_header(path):
    """A copy of a precompiled header's source away from gcc's .gch, which
    clang would take for its own and refuse."""
    if not path.endswith("cmake_pch.hxx"):
        return path
    copy = path[:-len(".hxx")] + "-clang.hxx"
    with open(path) as f, open(copy, "w") as out:
        out.write(f.read())
    return copy


def check(entry):
    r = subprocess.run(clang_argv(entry), cwd=entry["directory"], capture_output=True, text=True)
    return entry["file"], r.returncode, r.stderr


units = json.load(open(db))
failed = []
with open(log, "w") as out, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for path, rc, err in pool.map(check, units):
        out.write(f"== {path}: {rc}\n{err}")
        if rc != 0:
            failed.append((path, err))
for path, err in failed:
    print(f"thread-safety: {path}:\n{err[-3000:]}")
if failed:
    print(f"thread-safety: {len(failed)} of {len(units)} units failed (all of it in {log})")
    sys.exit(1)
print(f"thread-safety: {len(units)} units clean")
PY
