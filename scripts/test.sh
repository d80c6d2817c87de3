#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest.
# Then builds with each sanitizer in QMIGD_SANITIZE (default in CI:
# "address thread"; locally: none) and runs the tests labelled `sanitizer`
# (unit, loopback, bad input) under it, in build-asan / build-tsan.
# Arguments go to the release build's ctest: `./scripts/test.sh -R NAME`
# runs one test. Each phase says how long it took; each ctest run ends with
# its ten slowest tests.
set -euo pipefail
if [ "${CI:-}" = true ]; then
    : "${QMIGD_SANITIZE=address thread}"
fi
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

./scripts/install-deps.sh
phase "installing dependencies"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
phase "building (release)"
run_ctest build "$@"
phase "release tests"

for san in ${QMIGD_SANITIZE:-}; do
    dir="build-$san"
    [ "$san" = address ] && dir=build-asan
    [ "$san" = thread ] && dir=build-tsan
    cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQMIGD_SANITIZE="$san" >/dev/null
    cmake --build "$dir" -j"$(nproc)" >"$dir/build.log" 2>&1 || { cat "$dir/build.log"; exit 1; }
    phase "building ($san)"
    run_ctest "$dir" -L sanitizer
    phase "$san tests"
done

# A short libFuzzer run of each target in tests/fuzz/CMakeLists.txt from its
# checked-in corpus, where clang is there; two at a time (one per core).
if [ -n "${QMIGD_SANITIZE:-}" ] && command -v clang++ >/dev/null 2>&1; then
    CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQMIGD_FUZZ=ON >/dev/null
    cmake --build build-fuzz --target fuzz_all -j"$(nproc)" >build-fuzz/build.log 2>&1 \
        || { cat build-fuzz/build.log; exit 1; }
    phase "building (fuzz)"
    run_ctest build-fuzz -L fuzz -j"$(nproc)"
    phase "fuzzing"
fi
