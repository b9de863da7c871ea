"""Admission control: VM starts (creates, fork children, resumes) are bounded, and
refused with E2B's capacity error before they could exhaust the node.

- At most `max_starts` VM starts run at once; the others wait their turn (a start is
  the node's costliest operation: QEMU spawn, memory restore, network, envd).
- A start is refused (429, `error_code: sandbox_capacity_unavailable`, `Retry-After`)
  when the node already runs `max_sandboxes` (0: no fixed limit), or when the node's
  available memory (MemAvailable, or its memory cgroup's room: hostmem.py) is below `reserve_mib` plus what the new sandbox
  needs at first (`first_touch_mib`, its memory is otherwise overcommitted: a restored
  guest maps its snapshot's pages copy-on-write and touches few of them). The check is
  made when the start gets its turn, against the memory the node really has then.
  Before refusing, a start waits for the pauses that are freeing VMs and releases the
  spare ones (warm VMs, VMs kept after pauses), then is checked again.

- A start is refused with 507 (`error_code: insufficient_storage`, not retried) while
  the disk of the node's state dir has less than `min_free_disk_mib` free: layers,
  uppers and memory files would fail mid-write; `/health` says so too (readiness).

Refusing is what keeps the host out of its OOM killer; the SDKs see a RateLimit error
(the Python SDK retries it after Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from host.hostmem import node_available_mib

from .errors import CapacityExceeded, OutOfDisk
from .states import SandboxState as S

# states in which a sandbox holds (or is about to hold) a VM
HOLDS_VM = frozenset({S.CREATING, S.RUNNING, S.RESUMING, S.PAUSING, S.SNAPSHOTTING,
                      S.FORKING, S.KILLING})
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class AdmissionPolicy:
    max_starts: int = 4
    max_sandboxes: int = 0          # 0: no fixed limit
    reserve_mib: int = 1024         # never start a VM that would leave less available
    first_touch_mib: int = 64       # what a restored sandbox needs at once, at least
    disk_path: Path | None = None   # the state dir: its filesystem's free space is checked
    min_free_disk_mib: int = 0      # refuse starts below this much free there (0: never)

    def need_mib(self, memory_mb: int) -> int:
        """What a restored sandbox of `memory_mb` touches at first (its RAM is otherwise
        overcommitted: copy-on-write of its snapshot)."""
        return max(self.first_touch_mib, min(memory_mb, self.first_touch_mib * 4))


class Admission:
    def __init__(self, policy: AdmissionPolicy | None = None, *,
                 available_mib: Callable[[], int] = node_available_mib,
                 free_disk_mib: Callable[[Path], int] | None = None) -> None:
        self.policy = policy or AdmissionPolicy()
        self._free_disk_mib = free_disk_mib or _free_mib
        self._slots = asyncio.Semaphore(max(1, self.policy.max_starts))
        self._available_mib = available_mib
        self.in_flight = 0              # starts past the check, not finished
        self.peak_in_flight = 0
        # pauses answered before they were committed (pausing.py): their VMs still count
        self.releasing: set[asyncio.Task[Any]] = set()
        # releases what holds memory for work not asked for (warm and kept VMs): tried
        # before a start is refused; how many VMs it released
        self.spare: Callable[[], Awaitable[int]] | None = None
        self.draining = False  # the node is stopping: no start is taken (drain.py)

    def releases(self, task: asyncio.Task[Any]) -> None:
        """`task` frees a VM when it ends (a pause answered before its commit): a start
        that would be refused meanwhile waits for such tasks, then is checked again, so
        a create right after a pause's answer is not refused for the paused one."""
        self.releasing.add(task)
        task.add_done_callback(self.releasing.discard)

    @contextlib.asynccontextmanager
    async def start(self, sandbox_id: str, memory_mb: int,
                    holding: Callable[[], Awaitable[int]]) -> AsyncIterator[None]:
        """Hold a start slot for the VM start in the `async with` body; CapacityExceeded
        when the node cannot take it. `holding()`: how many sandboxes hold a VM now
        (this one included)."""
        if self.draining:
            raise CapacityExceeded(
                f"this node is stopping and pauses its sandboxes (drain); retry in a moment "
                f"(sandbox {sandbox_id} was not started)", retry_after_s=RETRY_AFTER_S)
        async with self._slots:
            if (problem := self.disk_problem()) is not None:  # no VM release frees disk
                raise OutOfDisk(f"{problem}; sandbox {sandbox_id} was not started")
            # the count is a store query: only made when there is a limit to check
            count = await holding() if self.policy.max_sandboxes else 0
            try:
                self._check(sandbox_id, memory_mb, count)
            except CapacityExceeded:
                if not await self._make_room():
                    raise
                count = await holding() if self.policy.max_sandboxes else 0
                self._check(sandbox_id, memory_mb, count)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                yield
            finally:
                self.in_flight -= 1

    async def _make_room(self) -> bool:
        """Before a start is refused: wait for the pauses that are freeing VMs, release
        the spare ones; whether anything was freed (the start is then checked again)."""
        freed = bool(self.releasing)
        if freed:
            await asyncio.wait(set(self.releasing))
        if self.spare is not None:
            freed = bool(await self.spare()) or freed
        return freed

    def disk_problem(self) -> str | None:
        """Why the state dir's disk cannot take new sandboxes, or None."""
        p = self.policy
        if not p.min_free_disk_mib or p.disk_path is None:
            return None
        free = self._free_disk_mib(p.disk_path)
        if free >= p.min_free_disk_mib:
            return None
        return (f"this node's disk is nearly full: {free} MiB free under {p.disk_path}, "
                f"below its floor of {p.min_free_disk_mib} MiB (--min-free-disk-mib); "
                "free space (aenv gc, kill sandboxes, delete snapshots or templates)")

    def _check(self, sandbox_id: str, memory_mb: int, holding: int) -> None:
        p = self.policy
        if p.max_sandboxes and holding > p.max_sandboxes:
            raise CapacityExceeded(
                f"this node runs its maximum of {p.max_sandboxes} sandboxes; kill or pause "
                f"one, or retry later (sandbox {sandbox_id} was not started)",
                retry_after_s=RETRY_AFTER_S)
        need = p.need_mib(memory_mb)
        available = self._available_mib()
        if available - need < p.reserve_mib:
            raise CapacityExceeded(
                f"this node is out of memory for another sandbox: {available} MiB "
                f"available, {need} MiB needed at start and {p.reserve_mib} MiB kept in "
                f"reserve; kill or pause sandboxes, or retry later (sandbox {sandbox_id} "
                "was not started)", retry_after_s=RETRY_AFTER_S)


def _free_mib(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize >> 20
