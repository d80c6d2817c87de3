#!/usr/bin/env bash
# Runs the suites over and over to find tests that fail only sometimes:
#   scripts/flake-hunt.sh N [--hog] [--trees "release address thread"] [-j P] [-- CTEST_ARGS]
# Each of N rounds runs the release suite and the sanitizer trees' suites
# (tests labelled `sanitizer`) side by side, each ctest P tests at a time
# (default 1), with --hog a busy loop taking one CPU meanwhile. Missing
# trees are built first. At the end, a table: each test that failed, in
# which tree, in how many rounds, and the first lines that say why; the
# logs stay in flake-hunt/. Exit status 1 if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/trees.sh

rounds=${1:?usage: scripts/flake-hunt.sh N [--hog] [--trees LIST] [-j P] [-- CTEST_ARGS]}
shift
hog= trees="release address thread" jobs=1
while [ $# -gt 0 ]; do
    case $1 in
        --hog) hog=yes ;;
        --trees) trees=$2; shift ;;
        -j) jobs=$2; shift ;;
        --) shift; break ;;
        *) echo "flake-hunt: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

tree_dir() { if [ "$1" = release ]; then echo build; else san_dir "$1"; fi; }

for t in $trees; do
    d=$(tree_dir "$t")
    [ -x "$d/bin/qmigd" ] && continue
    echo "flake-hunt: building $d"
    if [ "$t" = release ]; then
        build_tree build all -DCMAKE_BUILD_TYPE=Release >/dev/null
    else
        build_san_tree "$t" >/dev/null
    fi
done

out=build/flake-hunt
rm -rf "$out"
mkdir -p "$out"
hog_pid=
if [ -n "$hog" ]; then
    sh -c 'while :; do :; done' &
    hog_pid=$!
    trap 'kill "$hog_pid" 2>/dev/null || true' EXIT
fi

for round in $(seq "$rounds"); do
    t0=$SECONDS
    pids=()
    for t in $trees; do
        d=$(tree_dir "$t")
        labels=()
        [ "$t" = release ] || labels=(-L sanitizer)
        (cd "$d" && ctest -j"$jobs" --output-on-failure "${labels[@]}" "$@") \
            >"$out/round$round-$t.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    failed=$(cat "$out"/round"$round"-*.log | grep -c '\*\*\*\(Failed\|Timeout\|Exception\)' || true)
    echo "flake-hunt: round $round of $rounds: $failed failed ($((SECONDS - t0)) s)"
done

python3 - "$out" "$rounds" <<'PY'
import collections, glob, os, re, sys

out, rounds = sys.argv[1], int(sys.argv[2])
# ctest --output-on-failure: "12/39 Test #12: name ....***Failed  3.2 sec",
# then the test's output until the next test's line.
head = re.compile(r"^\s*\d+/\d+ Test\s+#\d+: (\S+) .*?(\*\*\*\w+|Passed|Not Run)")
why = re.compile(r"^(FAIL |.*FAILED:|.*waited .* for |.*Error|.*error:|.*ERROR: \w+Sanitizer|.*WARNING: ThreadSanitizer)")
fails = collections.defaultdict(list)  # (test, tree) -> [(round, lines)]
for log in sorted(glob.glob(os.path.join(out, "round*-*.log"))):
    rnd, tree = re.match(r"round(\d+)-(\w+)\.log", os.path.basename(log)).groups()
    current, lines = None, []
    for line in open(log, errors="replace"):
        m = head.match(line)
        if m:
            if current:
                fails[current].append((int(rnd), lines))
            current = (m.group(1), tree) if m.group(2).startswith("***") else None
            lines = []
        elif current and why.match(line) and len(lines) < 3:
            lines.append(line.strip()[:160])
    if current:
        fails[current].append((int(rnd), lines))
if not fails:
    print(f"flake-hunt: no failures in {rounds} rounds")
    sys.exit(0)
print(f"flake-hunt: failures in {rounds} rounds (logs in {out}/)")
print(f"{'test':38} {'tree':8} {'failed':>7}  why (first failure)")
for (test, tree), runs in sorted(fails.items(), key=lambda kv: -len(kv[1])):
    first = runs[0][1] or ["(no failure line: see the log)"]
    print(f"{test:38} {tree:8} {len(runs):>3}/{rounds:<3}  {first[0]}")
    for extra in first[1:]:
        print(f"{'':57}{extra}")
sys.exit(1)
PY
