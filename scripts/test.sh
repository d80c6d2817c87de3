#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest.
# QMIGD_SANITIZE=address|thread also builds and runs the unit and loopback
# tests under that sanitizer (build-asan / build-tsan).
set -euo pipefail
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
    cmake --build "$dir" -j"$(nproc)"
    (cd "$dir" && ctest --output-on-failure -L sanitizer)
done
