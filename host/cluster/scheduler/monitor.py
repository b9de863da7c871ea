"""`Sweeper`: the scheduler's owned task that declares dead the nodes whose heartbeats
stopped (scripts.SWEEP: their running sandboxes become `lost`) and forgets nodes whose
records expired. Idempotent, so every scheduler replica may run one.

Bound: a node is dead `misses x interval` after its last heartbeat (its liveness key
expires then; readers treat it as dead from that moment), and recorded dead with its
sandboxes lost within one sweep period more.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from host.tasks import cancel_and_wait

from ..registry import Registry

if TYPE_CHECKING:
    from .metrics import SchedulerMetrics

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(self, registry: Registry, *, interval_s: float = 1.0,
                 retention_s: float = 86400.0, metrics: SchedulerMetrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.interval_s = interval_s
        self.retention_ms = int(retention_s * 1000)
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="cluster-sweeper")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def sweep(self) -> dict[str, int]:
        """One sweep: {node id: sandboxes lost} of the nodes declared dead now."""
        dead = await self.registry.sweep(retention_ms=self.retention_ms)
        if self.metrics is not None:
            self.metrics.swept(dead)
        for node_id, lost in dead.items():
            log.warning("node %s missed its heartbeats: declared dead, %d running "
                        "sandbox(es) lost", node_id, lost)
        return dead

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis is down: try again next period
                if not self._failing:
                    log.warning("sweeping for dead nodes failed: %s", exc)
                self._failing = True
            else:
                self._failing = False
            await asyncio.sleep(self.interval_s)
