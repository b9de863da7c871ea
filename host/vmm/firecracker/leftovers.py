"""Firecracker processes whose handle was lost (a host service killed between spawn and
recording the VM), found from /proc, and what such a VM left outside its process.

A Firecracker process is matched to its work dir `<run_dir>/<name>/` by its argv: the
API socket (`--api-sock <run_dir>/<name>/firecracker.sock`), the jailer's chroot base
before it execs (`--chroot-base-dir <run_dir>/<name>/jail`), or, jailed after the exec,
the id the jailer passed on (`--id <id> --start-time-us ...`) when `<name>` recorded a
jail with that id. The /dev/nbdN devices a VM attached are recorded in its work dir at
once, so they can be detached after a crash.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from .. import procscan
from .jailer import API_SOCKET, jail_id, jail_record

DEVICES_FILE = "blockdevs.json"


def _opt(argv: list[str], key: str) -> str | None:
    for i, a in enumerate(argv):
        if a == key and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(key + "="):
            return a[len(key) + 1:]
    return None


def work_dir_name(argv: list[str], run_dir: Path, jails: dict[str, str]) -> str | None:
    """The name of the work dir under `run_dir` that a Firecracker (or jailer) process
    with this argv belongs to; `jails` maps jail ids to work dir names."""
    if not argv:
        return None
    for key, tail in (("--api-sock", API_SOCKET), ("--chroot-base-dir", "jail")):
        val = _opt(argv, key)
        if val is not None and val.startswith(f"{run_dir}/"):
            name, _, rest = val[len(str(run_dir)) + 1:].partition("/")
            if name and rest == tail:
                return name
    vm_id = _opt(argv, "--id")
    if vm_id is not None and vm_id in jails and _opt(argv, "--start-time-us") is not None:
        return jails[vm_id]
    return None


def _jails(work_dirs: list[Path]) -> dict[str, str]:
    found = {}
    for d in work_dirs:
        record = jail_record(d)
        if record is not None:
            found[str(record.get("id", jail_id(d)))] = d.name
    return found


def find_leftovers(run_dir: Path) -> dict[int, str]:
    """{pid: work dir name} of the Firecracker processes with a work dir in `run_dir`."""
    dirs: list[Path] = []
    with contextlib.suppress(OSError):
        dirs = [d for d in run_dir.iterdir() if d.is_dir()]
    jails = _jails(dirs)
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            name = work_dir_name(procscan.pid_cmdline(int(entry.name)), run_dir, jails)
            if name is not None:
                found[int(entry.name)] = name
    return found


def belongs_to(pid: int, work_dir: Path) -> bool:
    """Whether `pid` is the Firecracker (or jailer) process of `work_dir`."""
    argv = procscan.pid_cmdline(pid)
    return work_dir_name(argv, work_dir.parent, _jails([work_dir])) == work_dir.name


def record_devices(work_dir: Path, devices: list[Path]) -> None:
    (work_dir / DEVICES_FILE).write_text(json.dumps([str(d) for d in devices]))


def recorded_devices(work_dir: Path) -> list[Path]:
    try:
        return [Path(p) for p in json.loads((work_dir / DEVICES_FILE).read_text())]
    except (OSError, ValueError, TypeError):
        return []
