"""A node's heartbeat into the cluster index: an owned asyncio task that publishes, every
`interval_s`, the node's capacity and usage and the sandboxes it holds with their states.

Liveness: each heartbeat sets the node's liveness key to expire after `misses` intervals,
so the node counts as dead `misses * interval_s` after its last heartbeat (6 s with the
defaults 2 s x 3). Stopping the task (service shutdown) does not remove the key: a node
restarted within that time adopts its VMs and loses nothing.

Sandboxes: the first heartbeat sends the full list; later ones send only what changed
since the last one Redis accepted. Redis refuses a change list unless it holds this
node's full list (a sync token, random per process): after a FLUSHALL, or once the node
was declared dead, the very next heartbeat sends everything again, so a lost index is
rebuilt within one interval. Every `full_every` heartbeats the full list goes anyway, to
repair whatever else drifted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from host.tasks import cancel_and_wait

from .registry import NodeState, Registry

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0
DEFAULT_MISSES = 3


@dataclass(frozen=True, kw_only=True)
class NodeReport:
    """What one heartbeat publishes (besides the node's identity)."""

    cpu_count: int
    memory_mib: int
    available_mib: int
    max_sandboxes: int = 0
    reserve_mib: int = 0
    used_sandboxes: int = 0          # holding a VM
    load: float = 0.0
    sandboxes: Mapping[str, str] = field(default_factory=dict)   # id -> running | paused
    draining: bool = False

    def fields(self) -> dict[str, object]:
        return {"state": (NodeState.DRAINING if self.draining else NodeState.READY).value,
                "cpuCount": self.cpu_count, "memoryMiB": self.memory_mib,
                "availableMiB": self.available_mib,
                "usedMemoryMiB": max(0, self.memory_mib - self.available_mib),
                "maxSandboxes": self.max_sandboxes, "reserveMiB": self.reserve_mib,
                "usedSandboxes": self.used_sandboxes, "load": round(self.load, 3)}


class Heartbeat:
    """Call `start()`, then `await aclose()`; `beat()` is one heartbeat (tests)."""

    def __init__(self, registry: Registry, *, node_id: str, address: str, proxy_address: str,
                 report: Callable[[], Awaitable[NodeReport]],
                 interval_s: float = DEFAULT_INTERVAL_S, misses: int = DEFAULT_MISSES,
                 full_every: int = 30,
                 disown: Callable[[str], Awaitable[object]] | None = None,
                 joined: Callable[[], object] | None = None) -> None:
        if interval_s <= 0 or misses < 1:
            raise ValueError("interval_s > 0 and misses >= 1")
        self.registry = registry
        self.node_id = node_id
        self.address = address
        self.proxy_address = proxy_address
        self.report = report
        # drops this node's copy of a paused sandbox another node took over
        # (orchestrator.forget); None: nothing to drop (tests)
        self.disown = disown
        # called once, after the first heartbeat Redis accepted and the disowns it brought:
        # what the node may only do knowing what the cluster gave to others while it was
        # away (orchestrator.resume_drained); None: nothing (tests)
        self.joined = joined
        self.interval_s = interval_s
        self.misses = misses
        self.full_every = max(1, full_every)
        self.beats = 0                   # heartbeats Redis accepted
        self.draining = False            # set: the scheduler places nothing new here
        self._token = secrets.token_hex(8)
        self._published: dict[str, str] | None = None
        self._started_ms = int(time.time() * 1000)
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        # one heartbeat at a time: a change list is computed against the last one sent
        self._beating = asyncio.Lock()

    @property
    def dead_after_s(self) -> float:
        return self.interval_s * self.misses

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"heartbeat:{self.node_id}")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def now(self, *, draining: bool | None = None) -> bool:
        """One heartbeat now, not at the next interval (`draining`: set first): what the
        cluster must see before the node goes, at a drain's start (place nothing here)
        and end (its sandboxes paused, so another node may resume them from their
        handoffs, not running on a node that is gone: lost). False, logged, when it
        failed: the stop goes on."""
        if draining is not None:
            self.draining = draining
        why = await self._attempt()
        if why is not None:
            log.warning("heartbeat of node %s failed: %s", self.node_id, why)
        return why is None

    async def beat(self) -> None:
        async with self._beating:
            await self._beat()

    async def _beat(self) -> None:
        rep = await self.report()
        current = dict(rep.sandboxes)
        fields = {**rep.fields(), "address": self.address, "proxyAddress": self.proxy_address,
                  "startedAtMs": self._started_ms}
        if self.draining:
            fields["state"] = NodeState.DRAINING.value
        alive_ms = int(self.dead_after_s * 1000)
        previous = self._published
        full = previous is None or self.beats % self.full_every == 0
        disowned: tuple[str, ...] = ()
        if previous is not None and not full:
            upserts = {sid: st for sid, st in current.items() if previous.get(sid) != st}
            removals = [sid for sid in previous if sid not in current]
            answer = await self.registry.publish(
                self.node_id, fields, alive_ms=alive_ms, full=False, token=self._token,
                upserts=upserts, removals=removals)
            full, disowned = not answer, answer.disowned
            if full:
                log.info("cluster index lost node %s's sandboxes: sending all %d",
                         self.node_id, len(current))
        if full:
            answer = await self.registry.publish(self.node_id, fields, alive_ms=alive_ms,
                                                 full=True, token=self._token,
                                                 upserts=current)
            disowned = answer.disowned
        for sid in disowned:
            current.pop(sid, None)
            log.info("sandbox %s is held by another node now (taken over while node %s was "
                     "away): dropping this node's copy", sid, self.node_id)
            if self.disown is not None:
                await self.disown(sid)
        self._published = current
        self.beats += 1
        if self.beats == 1 and self.joined is not None:
            self.joined()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            why = await self._attempt()
            if why is not None:
                self._failed(why)
            else:
                if self._failing:
                    log.info("heartbeat of node %s restored", self.node_id)
                self._failing = False
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - began)))

    async def _attempt(self) -> str | None:
        """One heartbeat, bounded by the time the node counts as alive; why it failed,
        or None."""
        try:
            async with asyncio.timeout(self.dead_after_s):
                await self.beat()
        except TimeoutError:
            return "timed out"
        except Exception as exc:  # noqa: BLE001 - Redis or the report failed: the caller retries or goes on
            return str(exc) or type(exc).__name__
        return None

    def _failed(self, why: str) -> None:
        if not self._failing:
            log.warning("heartbeat of node %s failed (retrying every %.1f s): %s",
                        self.node_id, self.interval_s, why)
        self._failing = True
