"""Memory snapshots of QEMU VMs through memsnap: freeze a base, capture a diff, restore.

The QEMU driver's `freeze_memory`, `snapshot_memory` and `restore_memory` are these
functions over the VM's QMP client and pid. memsnap errors become `VmmSnapshotError`
here, at the driver boundary.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..driver import MemoryBacking
from ..errors import VmmError, memory_snapshot_errors
from ..memsnap import (
    PAGE_SIZE,
    BaseImage,
    MemSnapError,
    MemSnapshot,
    find_vma,
    freeze_base,
    restore_base_into,
    restore_into,
    scan_private,
    snapshot_incremental,
)


def private_mib(pid: int, mem: MemoryBacking | None) -> int | None:
    """MiB of the guest's RAM copied on write from its memory file (a private mapping:
    restored VMs); None for RAM in a shared file, or when the mapping cannot be read.
    One PAGEMAP_SCAN of the mapping: cheap enough to poll."""
    if mem is None or mem.shared:
        return None
    try:
        vma = find_vma(pid, mem.path)
        return sum(n for _, n in scan_private(pid, vma)) * PAGE_SIZE >> 20
    except (MemSnapError, OSError):
        return None


def check_restore_spec(name: str, mem: MemoryBacking | None, base: BaseImage) -> None:
    if mem is None or mem.shared or os.path.realpath(mem.path) != os.path.realpath(
            base.mem_path):
        raise VmmError(f"{name}: restoring a memory snapshot needs "
                       f"MemoryBacking(path={base.mem_path}, shared=False)")


async def restore(name: str, config_sha256: str, qmp: Any, pid: int, base: BaseImage,
                  snapshot: MemSnapshot | None, *, resume: bool) -> dict[str, float]:
    """Load `base` (+ `snapshot`'s chain) into a QEMU started with `-incoming defer -S`."""
    with memory_snapshot_errors(f"{name}: restore from {snapshot.dir if snapshot else base.dir}"):
        if snapshot is None:
            ms = await restore_base_into(qmp, pid, base.mem_path, base, resume=resume)
            return {"restore_ms": ms}
        stats = await restore_into(qmp, pid, base.mem_path, snapshot, base,
                                   config_sha256=bytes.fromhex(config_sha256),
                                   resume=resume)
        return {"restore_ms": stats.total_ms, "inject_ms": stats.inject_ms,
                "pages": float(stats.pages)}


async def freeze(name: str, mem: MemoryBacking | None, qmp: Any, dest: Path) -> BaseImage:
    if mem is None or not mem.shared:
        raise VmmError(f"{name}: freezing memory needs RAM in a shared file")
    with memory_snapshot_errors(f"{name}: freezing memory into {dest}"):
        return await freeze_base(qmp, mem.path, dest)


async def capture(name: str, config_sha256: str, qmp: Any, pid: int, dest: Path, *,
                  base: BaseImage,
                  parent: MemSnapshot | None, resume: bool, max_chain: int,
                  while_stopped: Callable[[], Awaitable[None]] | None) -> MemSnapshot:
    with memory_snapshot_errors(f"{name}: memory snapshot into {dest}"):
        return await snapshot_incremental(
            qmp, pid, base.mem_path, base, dest,
            config_sha256=bytes.fromhex(config_sha256), parent=parent,
            max_chain=max_chain, resume=resume, while_stopped=while_stopped)
