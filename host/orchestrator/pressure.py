"""Memory pressure: pause the coldest running sandboxes before the node runs out.

Sandboxes overcommit memory: a restored guest maps its snapshot copy-on-write and touches
few of its pages, so a node promises far more guest RAM than it has. When guests do touch
their memory the node would run out, and the kernel's OOM killer would pick a VM (or the
service) at random. Instead, every tick the guard reads what the node has left
(`host.hostmem.node_available_mib`: the host's MemAvailable, or what the service's memory
cgroup leaves, whichever is less); below `low_mib` it pauses running sandboxes, coldest first
(longest since a request reached them through the proxy, or since they started), one at
a time until `high_mib` is available again (warm VMs, which are no sandboxes yet, and
the VMs paused sandboxes kept go first: warm.py, kept.py; then the balloons of idle
sandboxes are inflated: balloons.py). A paused sandbox keeps everything (memory
and disk) and resumes on its next request, like a TTL pause. Admission (admission.py)
refuses new starts from the same number before they could push the node there.

The guard is owned by the orchestrator (`NodeOrchestrator.start()` / `aclose()`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from host.hostmem import node_available_mib
from host.tasks import cancel_and_wait, run_every

from .errors import OrchestratorError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PressurePolicy:
    low_mib: int = 768      # pause sandboxes once less than this is available
    high_mib: int = 1536    # ... until this much is available again
    interval_s: float = 0.25  # a few file reads: cheap; a guest allocates ~150 MiB/s


class PressureOwner(Protocol):
    """What the guard calls on its orchestrator (`NodeOrchestrator` implements it)."""

    def spawn(self, coro: Coroutine[Any, Any, T], /) -> asyncio.Task[T]: ...

    async def coldest_running(self) -> Sequence[str]:
        """Running sandboxes, coldest first."""
        ...

    async def reclaim_idle(self, need_mib: int) -> int:
        """Ask the coldest sandboxes' guests for up to `need_mib` through their balloons;
        the MiB they gave back."""
        ...

    async def deflate_active(self) -> list[str]:
        """Give their memory back to inflated sandboxes that got a request since."""
        ...

    async def pause_for_memory(self, sandbox_id: str) -> None:
        """Pause a running sandbox (memory + disk); OrchestratorError if it cannot."""
        ...

    async def release_spare(self) -> int:
        """Release what holds memory for work not yet asked for (warm VMs, kept VMs of
        paused sandboxes); how many."""
        ...


class PressureGuard:
    def __init__(self, owner: PressureOwner, policy: PressurePolicy | None = None, *,
                 available_mib: Callable[[], int] = node_available_mib) -> None:
        self.owner = owner
        self.policy = policy or PressurePolicy()
        self.available_mib = available_mib
        self.paused: list[str] = []   # every sandbox this guard paused, in order
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = self.owner.spawn(self._run())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        await run_every(self.policy.interval_s, self.tick, log=log,
                        failed="memory pressure check failed")

    async def tick(self) -> list[str]:
        """Pause the coldest running sandboxes while less than `low_mib` (then `high_mib`)
        is available; returns the ones paused."""
        p = self.policy
        available = await asyncio.to_thread(self.available_mib)
        if available >= p.low_mib:
            await self.owner.deflate_active()
            return []
        if await self.owner.release_spare():
            available = await asyncio.to_thread(self.available_mib)
            log.warning("memory pressure: released the warm and kept VMs; %d MiB available",
                        available)
        if available < p.high_mib:
            got = await self.owner.reclaim_idle(p.high_mib - available)
            if got:
                available = await asyncio.to_thread(self.available_mib)
                log.warning("memory pressure: idle sandboxes' balloons returned %d MiB; %d "
                            "MiB available", got, available)
        paused: list[str] = []
        for sid in await self.owner.coldest_running():
            if available >= p.high_mib:
                break
            try:
                await self.owner.pause_for_memory(sid)
            except OrchestratorError as exc:
                log.warning("memory pressure: pausing %s failed: %s", sid, exc)
                continue
            log.warning("memory pressure: %d MiB available (pausing below %d MiB): paused "
                        "%s, the coldest running sandbox", available, p.low_mib, sid)
            paused.append(sid)
            available = await asyncio.to_thread(self.available_mib)
        self.paused += paused
        return paused
