#!/usr/bin/env bash
# make-man.sh QMIGD QMIG OUTDIR: writes qmigd.1 and qmig.1 into OUTDIR with
# help2man, from the programs' own help texts (each subcommand's too), so
# the pages say what the programs do. Run by the build (target `man`).
set -euo pipefail
qmigd=$(realpath "$1") qmig=$(realpath "$2") out=$3
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Called by their installed names, so the pages show `qmigd`, not a build path.
ln -s "$qmigd" "$work/qmigd"
ln -s "$qmig" "$work/qmig"
export PATH="$work:$PATH"
version=$(qmigd --version | sed 's/^qmigd version //')

# help text as roff: each line kept as it is.
verbatim() { printf '.nf\n'; sed 's/\\/\\e/g; s/^\([.'"'"']\)/\\\&\1/'; printf '.fi\n'; }

{
    echo "[COMMANDS]"
    for sub in source dest guest limits; do
        echo ".SS \"qmigd $sub\""
        qmigd "$sub" --help | verbatim
    done
    cat <<'ROFF'
[EXAMPLES]
.nf
qmigd dest   \-\-qmp /tmp/dst.qmp \-\-ram mem=/dev/shm/dst.ram,size=256M &
qmigd source \-\-qmp /tmp/src.qmp \-\-ram mem=/dev/shm/src.ram,size=256M &
qmig run \-\-src /tmp/src.qmp \-\-dst /tmp/dst.qmp \-\-multifd 4 \e
    \-\-verify /dev/shm/src.ram:/dev/shm/dst.ram
.fi
[SEE ALSO]
.BR qmig (1),
.BR qemu-system-x86_64 (1),
.BR systemctl (1);
the units qmigd-dest@.service and qmigd-source@.service; the documentation
in /usr/share/doc/qmigd (README.md, docs/).
ROFF
} >"$work/qmigd.h2m"
help2man --no-info --no-discard-stderr --version-string="$version" \
    --name="QEMU-compatible live-migration daemons" --include="$work/qmigd.h2m" \
    --output="$out/qmigd.1" qmigd

{
    cat <<'ROFF'
[SYNOPSIS]
.B qmig
.I SOCK COMMAND
.RI [ NAME=VALUE " ...] [" \-\-wait ]
.br
.B qmig
.I SOCK
.BR hmp | wait | events " ..."
.br
.B qmig run
.RI [ options "] | " SCENARIO.json
.br
.B qmig certs
.I DIR
.RI [ options ]
ROFF
    echo "[COMMANDS]"
    echo '.SS "qmig run"'
    qmig run --help | verbatim
    echo '.SS "qmig certs"'
    qmig certs --help | verbatim
    cat <<'ROFF'
[SEE ALSO]
.BR qmigd (1),
.BR qemu-system-x86_64 (1);
QEMU's QMP reference for the commands; /usr/share/doc/qmigd/docs/monitor.md.
ROFF
} >"$work/qmig.h2m"
help2man --no-info --version-string="$version" \
    --name="QMP client and scripted migration runner for qmigd and QEMU" \
    --include="$work/qmig.h2m" --output="$out/qmig.1" qmig
