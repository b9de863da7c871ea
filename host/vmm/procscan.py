"""Finding VMM processes from /proc: the ones whose handle was lost (a host service killed
between spawn and recording the VM) and whether a recorded pid is still that VMM (pids
get reused). Linux-only, read-only; the drivers' `leftovers()` and `kill_pid()` use it.
"""

from __future__ import annotations

import os
from pathlib import Path

_NETNS_WRAPPERS = ("ip", "/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip")


def pid_cmdline(pid: int) -> list[str]:
    """argv of `pid` ([] when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [p.decode(errors="replace") for p in raw.split(b"\0") if p]


def pid_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _is_vmm(argv: list[str], binary: str) -> bool:
    """`argv` runs `binary` (by base name), directly or behind an `ip netns exec` that
    has not exec'd yet."""
    if not argv:
        return False
    if binary in os.path.basename(argv[0]):
        return True
    return argv[0] in _NETNS_WRAPPERS and any(binary in os.path.basename(a) for a in argv[1:6])


def is_vmm_for(pid: int, binary: str, socket: Path) -> bool:
    """Whether `pid` is a `binary` process whose command line names `socket`."""
    argv = pid_cmdline(pid)
    return _is_vmm(argv, binary) and any(str(socket) in a for a in argv)


def vmm_pids_under(run_dir: Path, binary: str, socket_name: str) -> dict[int, str]:
    """{pid: work dir name} of every `binary` process whose control socket
    (`<run_dir>/<name>/<socket_name>`) lies directly under `run_dir`."""
    prefix = f"{run_dir}/"
    found: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        argv = pid_cmdline(int(d.name))
        if not _is_vmm(argv, binary):
            continue
        for a in argv:
            i = a.find(prefix)
            if i < 0:
                continue
            rest = a[i + len(prefix):].split(",", 1)[0]
            name, _, tail = rest.partition("/")
            if name and tail == socket_name:
                found[int(d.name)] = name
                break
    return found
