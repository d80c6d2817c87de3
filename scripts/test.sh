#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest.
# Then builds with each sanitizer in QMIGD_SANITIZE (default in CI:
# "address thread"; locally: none) and runs the tests labelled `sanitizer`
# (unit, loopback, bad input) under it, in build-asan / build-tsan.
# Arguments go to the release build's ctest: `./scripts/test.sh -R NAME`
# runs one test. Each phase says how long it took; each ctest run ends with
# its ten slowest tests. Tests run one at a time unless CTEST_PARALLEL_LEVEL
# says more (tests/CMakeLists.txt marks what must run alone): two at a time
# saved 30% but failed 2 of 3 CI runs here on timing (docs/testing.md).
#
# The sanitizer and fuzz trees build one after the other in the background
# at nice 19 while the release tests run: the tests mostly wait on sockets,
# timers and QEMU, and a test's thread preempts a niced compiler when it
# wakes. Each test phase first waits for its tree.
set -euo pipefail
if [ "${CI:-}" = true ]; then
    : "${QMIGD_SANITIZE=address thread}"
fi
export CTEST_PARALLEL_LEVEL=${CTEST_PARALLEL_LEVEL:-1}
cd "$(dirname "$0")/.."

phase_start=$SECONDS
phase() {
    echo "test.sh: $1 took $((SECONDS - phase_start)) s (total $SECONDS s)"
    phase_start=$SECONDS
}

# ctest in DIR with ARGS, each test's lines as they come (an integration
# test says PASS/FAIL per case: no long silence), its output kept in
# DIR/ctest-output.log, then its ten slowest tests.
run_ctest() {
    local dir=$1
    shift
    local log="$dir/ctest-output.log" rc=0
    (cd "$dir" && ctest --verbose "$@") 2>&1 | grep --line-buffered -v \
        -e '^UpdateCTestConfiguration' -e '^Parse Config' -e '^ Add coverage exclude' \
        -e '^Constructing a list of tests' -e '^Updating test list' -e '^Checking test dependency' \
        -e '^[0-9]*: Test command:' -e '^[0-9]*: Working Directory:' -e '^[0-9]*: Environment variables:' \
        -e '^[0-9]*:  [A-Z_]*=' -e '^Test timeout computed' | tee "$log" || rc=$?
    echo "test.sh: slowest tests in $dir:"
    sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .* \([0-9.]*\) sec$/\2 \1/p' "$log" \
        | sort -rn | head -10 | awk '{printf "  %8.1f s  %s\n", $1, $2}'
    return "$rc"
}

# Configures DIR with cmake ARGS and builds its TARGET (output in
# DIR/build.log); then writes "STATUS SECONDS" to DIR/build.done, which
# wait_tree waits for.
build_tree() {
    local dir=$1 target=$2 t0=$SECONDS rc=0
    shift 2
    rm -f "$dir/build.done"
    mkdir -p "$dir"
    { cmake -S . -B "$dir" "$@" && cmake --build "$dir" --target "$target" -j"$(nproc)"; } \
        >"$dir/build.log" 2>&1 || rc=$?
    echo "$rc $((SECONDS - t0))" >"$dir/build.done"
}

# Waits for the background build of DIR (NAME in the phase line); its log
# and exit on failure. While nothing else runs, the builds run at nice 0
# (root may lower it; elsewhere they stay niced).
wait_tree() {
    local dir=$1 name=$2 rc secs
    [ -e "$dir/build.done" ] || renice -n 0 -g "$builds_pid" >/dev/null 2>&1 || true
    while [ ! -e "$dir/build.done" ]; do
        kill -0 "$builds_pid" 2>/dev/null || { echo "test.sh: the $name build died"; exit 1; }
        sleep 1
    done
    renice -n 19 -g "$builds_pid" >/dev/null 2>&1 || true
    read -r rc secs <"$dir/build.done"
    [ "$rc" = 0 ] || { cat "$dir/build.log"; echo "test.sh: building ($name) failed"; exit 1; }
    phase "waiting for the $name build (it took $secs s in the background)"
}

# -g1 keeps the line tables a sanitizer's report prints, not the variables'
# descriptions; ASan+UBSan at -O1 (ASan's own advice), TSan at -O2. Of
# -O2 -g they take 55% and 75% of the compiler's time.
san_flags() {
    case $1 in address) echo "-O1 -g1 -DNDEBUG" ;; *) echo "-O2 -g1 -DNDEBUG" ;; esac
}

san_dir() {
    case $1 in address) echo build-asan ;; thread) echo build-tsan ;; *) echo "build-$1" ;; esac
}

# libFuzzer targets where clang is there (tests/fuzz/CMakeLists.txt).
fuzz=
if [ -n "${QMIGD_SANITIZE:-}" ] && command -v clang++ >/dev/null 2>&1; then
    fuzz=yes
fi

./scripts/install-deps.sh
phase "installing dependencies"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
phase "building (release)"

# In a process group of its own (set -m), so that an early exit ends the
# compilers too.
builds_pid=
if [ -n "${QMIGD_SANITIZE:-}" ]; then
    set -m
    (
        renice -n 19 -p "$BASHPID" >/dev/null
        for san in $QMIGD_SANITIZE; do
            build_tree "$(san_dir "$san")" all -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQMIGD_SANITIZE="$san" \
                -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$(san_flags "$san")"
        done
        if [ -n "$fuzz" ]; then
            CXX=clang++ build_tree build-fuzz fuzz_all -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQMIGD_FUZZ=ON
        fi
    ) &
    builds_pid=$!
    set +m
    trap 'kill -- -"$builds_pid" 2>/dev/null || true' EXIT
fi

run_ctest build "$@"
phase "release tests"

for san in ${QMIGD_SANITIZE:-}; do
    dir=$(san_dir "$san")
    wait_tree "$dir" "$san"
    run_ctest "$dir" -L sanitizer
    phase "$san tests"
done

# A short libFuzzer run of each target from its checked-in corpus.
if [ -n "$fuzz" ]; then
    wait_tree build-fuzz fuzz
    run_ctest build-fuzz -L fuzz -j"$(nproc)"
    phase "fuzzing"
fi
