"""A cgroup per jailed VMM process: memory, pids, cpu and block I/O weight.

cgroup v2 where the host has it (one directory under `/sys/fs/cgroup/<parent>/<name>`,
the controllers enabled in the parent's `cgroup.subtree_control`); cgroup v1 otherwise, one
directory per controller (`/sys/fs/cgroup/<controller>/<parent>/<name>`), as on hosts that
still mount the legacy hierarchies. Limits are written before the process joins (it joins
itself, in its child, before exec: `join_paths()`), so a VMM never runs unlimited.

A controller the host lacks is left out and said once in the log; the memory and pids
controllers are required (`CgroupError`), since they are what bounds a hostile guest's
VMM on the host.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .. import procscan
from ..errors import VmmError

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000
_V1_CONTROLLERS = ("memory", "pids", "cpu", "blkio")
_REQUIRED = ("memory", "pids")
_warned: set[str] = set()


class CgroupError(VmmError):
    """The host cannot give a VMM its cgroup (controller missing, not writable)."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    memory_bytes: int
    pids: int
    cpu_quota_us: int  # per CPU_PERIOD_US
    io_weight: int  # 1-10000 (v2 io.weight), mapped to 10-1000 for v1 blkio.weight


def detect_version(root: Path = CGROUP_ROOT) -> int:
    """2 when the unified hierarchy has the memory and pids controllers, else 1 when the
    v1 memory and pids hierarchies are mounted; CgroupError otherwise."""
    controllers = root / "cgroup.controllers"
    if controllers.is_file():
        have = controllers.read_text().split()
        if all(c in have for c in _REQUIRED):
            return 2
    if all((root / c / "cgroup.procs").is_file() for c in _REQUIRED):
        return 1
    raise CgroupError(f"no cgroup hierarchy with the memory and pids controllers under {root}"
                      " (the VM jail needs them)")


def nested_parent(parent: str, version: int, *, proc: Path = Path("/proc/self/cgroup")) -> str:
    """`parent` below the cgroup this process runs in, under cgroup v1 (its memory
    controller's path): a node's own memory budget (a systemd slice, a container, an
    operator's limit) then bounds its VMs too. Under v2 a cgroup with processes may not
    have children with controllers, so VMs go under `parent` at the top."""
    if version != 1:
        return parent
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return parent
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            own = path.strip("/")
            return f"{own}/{parent}" if own else parent
    return parent


class Cgroup:
    """One VMM's cgroup; `create()` makes it and writes the limits, `remove()` deletes it
    once its processes are gone (idempotent)."""

    def __init__(self, parent: str, name: str, *, version: int,
                 root: Path = CGROUP_ROOT) -> None:
        self.parent, self.name, self.version, self.root = parent, name, version, root

    def dirs(self) -> dict[str, Path]:
        """controller ("" for v2) -> directory."""
        if self.version == 2:
            return {"": self.root / self.parent / self.name}
        return {c: self.root / c / self.parent / self.name for c in _V1_CONTROLLERS
                if (self.root / c).is_dir()}

    def join_paths(self) -> list[str]:
        """The `cgroup.procs` files a process writes its pid into to join."""
        return [str(d / "cgroup.procs") for d in self.dirs().values()]

    def create(self, limits: Limits) -> None:
        try:
            if self.version == 2:
                self._create_v2(limits)
            else:
                self._create_v1(limits)
        except OSError as exc:
            self.remove()
            raise CgroupError(f"cannot create cgroup {self.parent}/{self.name}: {exc}") from exc

    def _create_v2(self, limits: Limits) -> None:
        parent = self.root / self.parent
        parent.mkdir(exist_ok=True)
        wanted = [c for c in ("memory", "pids", "cpu", "io")
                  if c in (self.root / "cgroup.controllers").read_text().split()]
        for d in (self.root, parent):
            enabled = (d / "cgroup.subtree_control").read_text().split()
            missing = " ".join(f"+{c}" for c in wanted if c not in enabled)
            if missing:
                (d / "cgroup.subtree_control").write_text(missing)
        d = parent / self.name
        d.mkdir(exist_ok=True)
        (d / "memory.max").write_text(str(limits.memory_bytes))
        _optional(d / "memory.swap.max", "0")
        (d / "pids.max").write_text(str(limits.pids))
        _optional(d / "cpu.max", f"{limits.cpu_quota_us} {CPU_PERIOD_US}")
        _optional(d / "io.weight", f"default {limits.io_weight}")

    def _create_v1(self, limits: Limits) -> None:
        dirs = self.dirs()
        for c in _REQUIRED:
            if c not in dirs:
                raise CgroupError(f"cgroup v1 controller {c} is not mounted under {self.root}")
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        (dirs["memory"] / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        # without swap accounting the file is absent: nothing to bound there
        _optional(dirs["memory"] / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        (dirs["pids"] / "pids.max").write_text(str(limits.pids))
        if "cpu" in dirs:
            _optional(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _optional(dirs["cpu"] / "cpu.cfs_quota_us", str(limits.cpu_quota_us))
        if "blkio" in dirs:
            # blkio.weight exists only under a proportional I/O scheduler (BFQ); without one
            # the weight has nothing to act on
            weight = max(10, min(1000, limits.io_weight // 10))
            _optional(dirs["blkio"] / "blkio.weight", str(weight))
            _optional(dirs["blkio"] / "blkio.bfq.weight", str(weight))

    def procs(self) -> list[int]:
        pids: set[int] = set()
        for d in self.dirs().values():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return sorted(pids)

    def memory_limit(self) -> int | None:
        d = self.dirs().get("" if self.version == 2 else "memory")
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        try:
            text = (d / name).read_text().strip() if d else ""
        except OSError:
            return None
        return None if not text or text == "max" else int(text)

    def remove(self, *, settle_s: float = 2.0) -> None:
        """Delete the directories (rmdir: the kernel refuses while a process is inside).
        A process that died but is not reaped yet (a zombie stays in a v1 cgroup until its
        parent, or init, waits for it) is waited for up to `settle_s`; a live one is not."""
        deadline = time.monotonic() + settle_s
        for d in self.dirs().values():
            while not self._rmdir(d):
                pids = self.procs()
                if any(procscan.pid_alive(p) for p in pids) or time.monotonic() > deadline:
                    log.warning("cgroup %s still has processes %s", d, pids)
                    break
                time.sleep(0.02)

    @staticmethod
    def _rmdir(d: Path) -> bool:
        """False while the kernel says the cgroup is busy."""
        try:
            d.rmdir()
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            log.warning("cannot remove cgroup %s: %s", d, exc)
            return True
        # the parent too once it is empty: it sits in the service's own cgroup, which its
        # owner (systemd, a container, a test) must be able to remove
        with contextlib.suppress(OSError):
            d.parent.rmdir()
        return True


def _optional(path: Path, value: str) -> None:
    """Write a limit the kernel may not offer here; say once which one is missing."""
    try:
        path.write_text(value)
    except OSError as exc:
        key = path.name
        if key not in _warned:
            _warned.add(key)
            log.info("cgroup limit %s not set (%s): the host does not offer it",
                     key, os.strerror(exc.errno or 0))
