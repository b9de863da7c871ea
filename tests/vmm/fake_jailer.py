"""A stand-in `jailer` for the driver tests (no real jailer or Firecracker here).

Checks its arguments the way Firecracker's jailer documents them (docs/jailer.md:
`--id` of alphanumerics and '-' up to 64 characters, `--exec-file`, `--uid`, `--gid`,
`--chroot-base-dir`, optional `--netns` path and `--cgroup-version`, then `--` and
Firecracker's own arguments), builds `<chroot base>/<exec file name>/<id>/root`, copies
the exec file into it, and execs it as the jailer would (`--id=<id>
--start-time-us=<n> --start-time-cpu-us=<n>` + the arguments after `--`) in the chroot's
directory. It cannot chroot a Python fake, so it sets FAKE_FC_ROOT instead:
fake_firecracker.py then resolves absolute paths inside the chroot and refuses paths that
lead out of it. Each invocation's argv is appended to FAKE_JAILER_LOG (JSON lines).
Exits 64 with a message on a bad argument.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

_VALUED = {"--id", "--exec-file", "--uid", "--gid", "--chroot-base-dir", "--netns",
           "--cgroup-version", "--parent-cgroup", "--cgroup", "--resource-limit"}
_FLAGS = {"--daemonize", "--new-pid-ns"}


def fail(msg: str) -> int:
    print(f"fake jailer: {msg}", file=sys.stderr, flush=True)
    return 64


def main(argv: list[str]) -> int:
    if log := os.environ.get("FAKE_JAILER_LOG"):
        with open(log, "a") as f:
            f.write(json.dumps(argv) + "\n")
    if "--" not in argv:
        return fail("no '--' before the Firecracker arguments")
    sep = argv.index("--")
    own, fc_args = argv[:sep], argv[sep + 1:]
    opts: dict[str, str] = {}
    i = 0
    while i < len(own):
        if own[i] in _FLAGS:
            return fail(f"{own[i]} would change the process the driver waits for")
        if own[i] not in _VALUED or i + 1 >= len(own):
            return fail(f"unknown or incomplete argument {own[i]!r}")
        opts[own[i]] = own[i + 1]
        i += 2
    for need in ("--id", "--exec-file", "--uid", "--gid"):
        if need not in opts:
            return fail(f"missing {need}")
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", opts["--id"]):
        return fail(f"invalid id {opts['--id']!r}")
    exec_file = Path(opts["--exec-file"])
    if not exec_file.is_absolute() or not os.access(exec_file, os.X_OK):
        return fail(f"exec file {exec_file} is not an absolute path to an executable")
    if not (opts["--uid"].isdigit() and opts["--gid"].isdigit()):
        return fail("uid and gid must be numbers")
    base = Path(opts.get("--chroot-base-dir", "/srv/jailer"))
    if not base.is_absolute():
        return fail(f"chroot base {base} is not absolute")
    if "--netns" in opts and not opts["--netns"].startswith("/"):
        return fail(f"--netns takes a path (/var/run/netns/NAME), got {opts['--netns']}")
    if opts.get("--cgroup-version", "2") not in ("1", "2"):
        return fail("cgroup version must be 1 or 2")
    if fc_args[:1] == ["--id"] or any(a.startswith("--id") for a in fc_args):
        return fail("the jailer passes --id itself")
    root = base / exec_file.name / opts["--id"] / "root"
    root.mkdir(parents=True, exist_ok=True)
    inside = root / exec_file.name
    shutil.copy(exec_file, inside)
    os.chown(root, int(opts["--uid"]), int(opts["--gid"]))
    os.chdir(root)
    env = {**os.environ, "FAKE_FC_ROOT": str(root)}
    os.execve(inside, [f"./{exec_file.name}", f"--id={opts['--id']}", "--start-time-us=1",
                       "--start-time-cpu-us=1", *fc_args], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
