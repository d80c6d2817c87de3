#!/usr/bin/env bash
# The main job on a built-in default: a 1 GiB mixed-content RAM image
# migrates from `qmigd source` to `qmigd dest` over 4 multifd channels with
# multifd zero-page detection; prints both sides' `info migrate` and checks
# that the images are identical. `--qemu-source` uses a real QEMU 10 source.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
exec python3 scripts/demo.py "$@"
