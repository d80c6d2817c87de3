#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest.
# Then builds with each sanitizer in QMIGD_SANITIZE (default in CI:
# "address thread"; locally: none) and runs the tests labelled `sanitizer`
# (unit, loopback, bad input) under it, in build-asan / build-tsan.
set -euo pipefail
if [ "${CI:-}" = true ]; then
    : "${QMIGD_SANITIZE=address thread}"
fi
cd "$(dirname "$0")/.."

./scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
(cd build && ctest --output-on-failure "$@")

for san in ${QMIGD_SANITIZE:-}; do
    dir="build-$san"
    [ "$san" = address ] && dir=build-asan
    [ "$san" = thread ] && dir=build-tsan
    cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQMIGD_SANITIZE="$san" >/dev/null
    cmake --build "$dir" -j"$(nproc)" >"$dir/build.log" 2>&1 || { cat "$dir/build.log"; exit 1; }
    (cd "$dir" && ctest --output-on-failure -L sanitizer)
done

# A short libFuzzer run of each target (the list: tests/fuzz/CMakeLists.txt)
# from its corpus, where clang is there.
if [ -n "${QMIGD_SANITIZE:-}" ] && command -v clang++ >/dev/null 2>&1; then
    CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DQMIGD_FUZZ=ON >/dev/null
    cmake --build build-fuzz --target fuzz_all \
        -j"$(nproc)" >build-fuzz/build.log 2>&1 || { cat build-fuzz/build.log; exit 1; }
    (cd build-fuzz && ctest --output-on-failure -L fuzz)
fi
