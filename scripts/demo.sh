#!/usr/bin/env bash
# The main job on a built-in default: a 1 GiB mixed-content RAM image
# migrates from `qmigd source` to `qmigd dest` over 4 multifd channels with
# multifd zero-page detection; prints both sides' `info migrate` and checks
# that the images are identical. `--qemu-source` uses a real QEMU 10 source.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
# The first build takes a minute or two on two cores: say so, and show it go.
echo "demo: building qmigd in build/ (first time: about 2 minutes on 2 cores)..."
cmake --build build -j"$(nproc)" | while IFS= read -r line; do
    case "$line" in "["*"%]"*) printf '\r%s' "${line%%]*}]" ;; esac
done
echo
exec python3 scripts/demo.py "$@"
