#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest,
# side by side (CTEST_PARALLEL_LEVEL, default: the number of CPUs).
#   ./scripts/test.sh                 the release tests and clang's
#                                     thread-safety analysis; under CI also
#                                     the ASan+UBSan tree (clang, with the
#                                     fuzz targets) and the TSan tree
#   ./scripts/test.sh --quick         the unit tests and a few small
#                                     integration tests (label quick), in
#                                     about three minutes from a built tree
#   ./scripts/test.sh -R NAME         arguments go to the release ctest
# QMIGD_SANITIZE picks the sanitizer trees (default in CI: "address
# thread"; locally: none); each runs the tests labelled `sanitizer`, the
# ASan tree also those labelled `fuzz`.
# Each phase says how long it took; each ctest run ends with its ten
# slowest tests. docs/testing.md has the measured phases.
#
# The sanitizer trees (or, without them, the thread-safety check) build one
# after the other in the background at nice 19 while the release tests run:
# the tests mostly wait on sockets, timers and QEMU, and a test's thread
# preempts a niced compiler when it wakes. After the release tests, each
# sanitizer tree's tests start as soon as the tree is there, side by side.
set -euo pipefail
quick=
if [ "${1:-}" = --quick ]; then
    quick=yes
    shift
fi
if [ "${CI:-}" = true ] && [ -z "$quick" ]; then
    : "${QMIGD_SANITIZE=address thread}"
fi
[ -z "$quick" ] || QMIGD_SANITIZE=
export CTEST_PARALLEL_LEVEL=${CTEST_PARALLEL_LEVEL:-$(nproc)}
cd "$(dirname "$0")/.."
. scripts/lib/trees.sh

phase_start=$SECONDS
phase() {
    echo "test.sh: $1 took $((SECONDS - phase_start)) s (total $SECONDS s)"
    phase_start=$SECONDS
}

# ctest in DIR with ARGS, each test's lines as they come (an integration
# test says PASS/FAIL per case: no long silence), each line prefixed with
# PREFIX when two ctest runs share the terminal, its output kept in
# DIR/ctest-output.log, then its ten slowest tests.
run_ctest() {
    local dir=$1 prefix=$2
    shift 2
    local log="$dir/ctest-output.log" rc=0
    (cd "$dir" && ctest --verbose "$@") 2>&1 | grep --line-buffered -v \
        -e '^UpdateCTestConfiguration' -e '^Parse Config' -e '^ Add coverage exclude' \
        -e '^Constructing a list of tests' -e '^Updating test list' -e '^Checking test dependency' \
        -e '^[0-9]*: Test command:' -e '^[0-9]*: Working Directory:' -e '^[0-9]*: Environment variables:' \
        -e '^[0-9]*:  [A-Z_]*=' -e '^Test timeout computed' | tee "$log" \
        | sed -u "s/^/$prefix/" || rc=$?
    {
        echo "test.sh: slowest tests in $dir:"
        sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .* \([0-9.]*\) sec$/\2 \1/p' "$log" \
            | sort -rn | head -10 | awk '{printf "  %8.1f s  %s\n", $1, $2}'
        grep -A40 "tests passed.*tests failed" "$log" | grep -v "^$" || true
    } | sed "s/^/$prefix/"
    return "$rc"
}

# Runs CMD... (its output in DIR/build.log); then writes "STATUS SECONDS"
# to DIR/build.done, which wait_tree waits for.
background_step() {
    local dir=$1 t0=$SECONDS rc=0
    shift
    rm -f "$dir/build.done"
    mkdir -p "$dir"
    "$@" >"$dir/build.log" 2>&1 || rc=$?
    echo "$rc $((SECONDS - t0))" >"$dir/build.done"
}

# Waits for the background step of DIR (NAME in the phase line); its log
# and exit on failure. While nothing else runs, the builds run at nice 0
# (root may lower it; elsewhere they stay niced).
wait_tree() {
    local dir=$1 name=$2 rc secs
    [ -e "$dir/build.done" ] || renice -n 0 -g "$builds_pid" >/dev/null 2>&1 || true
    while [ ! -e "$dir/build.done" ]; do
        kill -0 "$builds_pid" 2>/dev/null || { echo "test.sh: the $name step died"; exit 1; }
        sleep 1
    done
    renice -n 19 -g "$builds_pid" >/dev/null 2>&1 || true
    read -r rc secs <"$dir/build.done"
    [ "$rc" = 0 ] || { tail -200 "$dir/build.log"; echo "test.sh: $name failed"; exit 1; }
    phase "waiting for $name (it took $secs s in the background)"
}

./scripts/install-deps.sh
phase "installing dependencies"
# The ASan+UBSan tree is clang's, with the libFuzzer targets, and its build
# is the thread-safety analysis (scripts/lib/trees.sh); CI needs it so.
clang_asan=
case " ${QMIGD_SANITIZE:-} " in *" address "*)
    if asan_is_clang; then
        clang_asan=yes
    elif [ "${CI:-}" = true ]; then
        echo "test.sh: CI builds ASan+UBSan and the fuzz targets with clang++ and its libFuzzer; neither is here"
        exit 1
    fi ;;
esac
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
phase "building (release)"

# In a process group of its own (set -m), so that an early exit ends the
# compilers too.
builds_pid=
if [ -z "$quick" ]; then
    set -m
    (
        renice -n 19 -p "$BASHPID" >/dev/null
        # TSan's tree first: its tests take longest.
        for san in thread address; do
            case " ${QMIGD_SANITIZE:-} " in *" $san "*)
                background_step "$(san_dir "$san")" build_san_tree "$san" ;;
            esac
        done
        [ -n "$clang_asan" ] || background_step build/thread-safety ./scripts/thread-safety.sh build
    ) &
    builds_pid=$!
    set +m
    trap 'kill -- -"$builds_pid" 2>/dev/null || true' EXIT
fi

if [ -n "$quick" ]; then
    run_ctest build "" -L quick "$@"
    phase "quick tests"
    exit 0
fi
run_ctest build "" "$@"
phase "release tests"

# Then the sanitizer trees' tests and the fuzz runs side by side, each as
# soon as its tree is built: a sanitized test waits on its peers about as
# much as a release one, and the fuzz targets fill what they leave.
pids=()
for san in thread address; do
    case " ${QMIGD_SANITIZE:-} " in *" $san "*) ;; *) continue ;; esac
    dir=$(san_dir "$san")
    wait_tree "$dir" "the $san build"
    # A clang ASan tree has the fuzz targets: a short libFuzzer run of each
    # from its checked-in corpus, beside the sanitizer tests.
    run_ctest "$dir" "[$san] " -L "sanitizer|fuzz" &
    pids+=($!)
done
[ -n "$clang_asan" ] || wait_tree build/thread-safety "the thread-safety analysis"
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
[ "${#pids[@]}" = 0 ] || phase "sanitizer tests and fuzzing"
[ "$rc" = 0 ] || { echo "test.sh: sanitizer or fuzz tests failed"; exit 1; }
