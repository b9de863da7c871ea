"""Reclaim memory from idle sandboxes through their balloons, before pausing any.

Every VM has a virtio-balloon with free-page reporting (host/vmm): what a guest frees goes
back to the host by itself within seconds. What a guest does not free is its page cache:
an idle sandbox that built or read a lot keeps hundreds of MiB the host could use. Under
memory pressure (pressure.py) the guard first inflates the balloons of the coldest running
sandboxes, each by its guest's page cache (bounded by what it reports it can spare,
MemAvailable, less a headroom), so the guest drops cache it would re-read from its disk
instead of being paused. Its free memory is not asked for: reporting already returned it,
and a balloon over it would only make the guest touch pages to give them back. Pausing
stays the last resort, for when balloons did not return enough.

A sandbox that gets a request again (`Context.activity`, the proxy's) has its balloon
deflated at the next tick: it may need its memory. Its guest can also take pages back on
its own (deflate-on-oom) rather than OOM-kill. A restored VM starts deflated
(runtime/machines.py), so a pause or fork of an inflated sandbox carries nothing over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from host.contract import Balloon, SandboxRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BalloonPolicy:
    headroom_mib: int = 64   # what each inflated guest keeps available beyond its use
    min_gain_mib: int = 16   # a smaller inflation is not worth the guest's work
    settle_s: float = 5.0    # how long a reclaim waits for guests to reach their targets
    poll_s: float = 0.25


class Balloons:
    """The balloons this node inflated, by sandbox id. Owned by the orchestrator; called
    by the pressure guard's tick (one at a time: no locking)."""

    def __init__(self, runtime: SandboxRuntime, activity: Mapping[str, float], *,
                 clock: Callable[[], float], policy: BalloonPolicy | None = None) -> None:
        self.runtime = runtime
        self.activity = activity
        self.clock = clock  # the one `activity` is in
        self.policy = policy or BalloonPolicy()
        # sandbox id -> when its balloon was inflated: a request after it means active
        self.inflated: dict[str, float] = {}
        self.returned_mib = 0  # what the inflated balloons hold now (last reading)

    @property
    def supported(self) -> bool:
        return callable(getattr(self.runtime, "set_balloon", None))

    async def reclaim(self, coldest: Sequence[str], need_mib: int) -> int:
        """Inflate the balloons of `coldest` (coldest first) until `need_mib` is asked,
        then wait (up to `settle_s`) for the guests to give it; returns the MiB they
        returned."""
        if not self.supported or need_mib <= 0:
            return 0
        p = self.policy
        asked = 0
        before: dict[str, int] = {}
        for sid in coldest:
            if asked >= need_mib:
                break
            b = await self._read(sid)
            if b is None or b.available_mib is None or b.caches_mib is None:
                continue  # no balloon, or its guest has not reported yet
            gain = min(b.caches_mib, b.available_mib - p.headroom_mib, need_mib - asked)
            if gain < p.min_gain_mib:
                continue
            target = b.target_mib + gain
            try:
                await self.runtime.set_balloon(sid, target)
            except Exception as exc:  # noqa: BLE001 - one guest must not stop the reclaim
                log.warning("memory pressure: inflating %s's balloon failed: %s", sid, exc)
                continue
            before[sid] = b.size_mib
            self.inflated[sid] = self.clock()
            asked += gain
            log.info("memory pressure: inflating %s's balloon to %d MiB (+%d)", sid, target,
                     gain)
        return await self._settle(before, asked)

    async def _settle(self, before: dict[str, int], asked: int) -> int:
        """Poll the inflated balloons until they got `asked` or `settle_s` passed."""
        if not before:
            return 0
        deadline = self.clock() + self.policy.settle_s
        got = 0
        while True:
            sizes = {sid: await self._size(sid) for sid in before}
            got = sum(max(0, sizes[sid] - before[sid]) for sid in before)
            if got >= asked or self.clock() >= deadline:
                break
            await asyncio.sleep(self.policy.poll_s)
        await self._total()
        return got

    async def release_active(self, running: set[str]) -> list[str]:
        """Deflate the balloons of sandboxes that got a request since they were inflated;
        forget the ones not `running` any more (paused, killed: a restore starts them
        deflated)."""
        out: list[str] = []
        for sid in set(self.inflated) - running:
            self.inflated.pop(sid)
        for sid, since in list(self.inflated.items()):
            if self.activity.get(sid, 0.0) <= since:
                continue
            try:
                await self.runtime.set_balloon(sid, 0)
            except Exception as exc:  # noqa: BLE001 - gone, or its VM exited: nothing held
                log.debug("deflating %s's balloon: %s", sid, exc)
            self.inflated.pop(sid, None)
            out.append(sid)
        if out:
            log.info("deflated the balloons of %s: active again", ", ".join(out))
            await self._total()
        return out

    async def _read(self, sid: str) -> Balloon | None:
        try:
            return await self.runtime.balloon(sid)
        except Exception as exc:  # noqa: BLE001 - not running here now, or its VMM failed
            log.debug("balloon of %s: %s", sid, exc)
            return None

    async def _size(self, sid: str) -> int:
        b = await self._read(sid)
        return b.size_mib if b is not None else 0

    async def _total(self) -> None:
        self.returned_mib = sum([await self._size(sid) for sid in list(self.inflated)])
