#!/usr/bin/env python3
"""The one-way rule between rooms, checked on every build.

protocol/ includes only itself; ramstate/ and monitor/ add protocol/;
daemon/ may use every room, but within it the source's room (daemon/source/)
and the destination's (daemon/dest/) never include each other, the shared
rooms (daemon/io, tls, park, service and the files at daemon/ itself) include
neither role, and only the daemon that wires both roles (daemon/daemon.*,
migration_commands.cpp and the other commands' files, daemon_metrics.cpp,
main.cpp) and the tools see it.
Prints each include that breaks the rule and exits 1.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
ROLES = ("daemon/source/", "daemon/dest/")
WIRING = {"daemon/daemon.h", "daemon/daemon.cpp", "daemon/daemon_metrics.cpp",
          "daemon/migration_commands.cpp", "daemon/main.cpp"}
# The daemon's other monitor commands, in files of their own.
WIRING |= {"daemon/yank_commands.cpp", "daemon/migration_mode.cpp"}


def allowed(path, inc):
    """Whether file `path` (relative, posix) may include `inc`."""
    room = path.split("/")[0]
    if room == "protocol":
        return inc.startswith("protocol/")
    if room in ("ramstate", "monitor"):
        return inc.startswith((room + "/", "protocol/"))
    if room != "daemon":
        return True
    if path in WIRING or path.startswith("daemon/tools/") and inc.startswith("daemon/tools/"):
        return True
    if inc == "daemon/daemon.h" or inc.startswith("daemon/tools/"):
        return False
    for role, other in (ROLES, ROLES[::-1]):
        if path.startswith(role):
            return not inc.startswith(other)
    return not inc.startswith(ROLES)


def main():
    bad = []
    for room in ("protocol", "ramstate", "monitor", "daemon"):
        for f in sorted((ROOT / room).rglob("*")):
            if f.suffix not in (".h", ".cpp"):
                continue
            rel = f.relative_to(ROOT).as_posix()
            for inc in INCLUDE.findall(f.read_text(errors="replace")):
                if "/" in inc and not allowed(rel, inc):
                    bad.append(f"{rel}: includes {inc}")
    for line in bad:
        print(f"check-includes: {line} (against the one-way rule between rooms)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
