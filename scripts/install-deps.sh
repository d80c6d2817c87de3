#!/usr/bin/env bash
# Installs qmigd's build and test dependencies. Idempotent: does nothing
# that is already done. QEMU >= 10.0 comes from bookworm-backports on Debian 12.
# linux-image-amd64, busybox-static and cpio: the real guest of test_park.py.
# prometheus (with promtool): test_metrics.py scrapes qmigd with the real one.
# libseccomp-dev: --sandbox. libmicrohttpd-dev: --metrics. python3-matplotlib: the
# benchmarks' --plot charts.
# help2man: the qmigd(1) and qmig(1) man pages (man-db: test_package reads them).
# clang and libclang-rt-14-dev: the ASan+UBSan tree, its libFuzzer targets
# and the thread-safety analysis.
# debootstrap and systemd-container: test_package.py installs the .deb on a
# fresh Debian 12 and boots systemd there.
set -euo pipefail

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

need_pkgs=()
for p in build-essential cmake pkg-config libuv1-dev nlohmann-json3-dev \
         libcli11-dev libspdlog-dev catch2 python3 zlib1g-dev libzstd-dev \
         libgnutls28-dev gnutls-bin linux-image-amd64 busybox-static cpio file \
         libmicrohttpd-dev prometheus libseccomp-dev python3-matplotlib help2man man-db \
         debootstrap systemd-container clang libclang-rt-14-dev gdb; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
        || need_pkgs+=("$p")
done

qemu_ok() {
    command -v qemu-system-x86_64 >/dev/null 2>&1 || return 1
    local v
    v=$(qemu-system-x86_64 --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -1)
    [ -n "$v" ] && [ "$v" -ge 10 ]
}

updated=0
apt_update() {
    [ "$updated" -eq 1 ] && return 0
    $SUDO apt-get update -qq
    updated=1
}

if [ "${#need_pkgs[@]}" -gt 0 ]; then
    apt_update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        "${need_pkgs[@]}" >/dev/null
fi

if ! qemu_ok; then
    bp=/etc/apt/sources.list.d/bookworm-backports.sources
    src=/etc/apt/sources.list.d/debian.sources
    if [ ! -f "$bp" ] && [ -f "$src" ]; then
        # First stanza of debian.sources, with the suite swapped for backports.
        awk 'BEGIN{RS=""; ORS="\n"} NR==1{print; exit}' "$src" \
            | sed 's/^Suites:.*/Suites: bookworm-backports/' | $SUDO tee "$bp" >/dev/null
    fi
    updated=0
    apt_update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        -t bookworm-backports qemu-system-x86 >/dev/null
    qemu_ok || { echo "install-deps: QEMU >= 10 not available" >&2; exit 1; }
fi
# qemu-img (qemu-utils, the same version): test_capabilities.py makes a
# qcow2 disk carrying a dirty bitmap.
if ! command -v qemu-img >/dev/null 2>&1; then
    apt_update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        -t bookworm-backports qemu-utils >/dev/null \
        || echo "install-deps: qemu-utils not installed: the dirty-bitmap test will skip" >&2
fi
echo "install-deps: ok ($(qemu-system-x86_64 --version | head -1))"
