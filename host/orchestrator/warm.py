"""Warm VMs: creates from a template take a VM restored before they came.

Under TCG most of a create is the guest running code its VM has not translated yet (the
first /health after a restore takes ~130 ms, the next ~15 ms), and on any host a restore
spawns a VMM, builds a network and a disk stack. The pool keeps `size` VMs of the
template creates came from last restored, answered once, and stopped
(`SandboxRuntime.start(hold=True)`), each under the sandbox id its create will use: a
create takes one (`take`), continues it (`start` of the same id) and /inits envd as for
any restore. After each take a background task restores a replacement.

Only creates with the default network policy take a warm VM (its rules are those), and
only from the template most recently created from: another template's warm VMs are
released when creates move on. A warm VM is no sandbox yet (no record in the store):
after a crash, recovery reaps it as an orphan. Under memory pressure (pressure.py) the
pool is emptied before any sandbox is paused, and refilling waits for the room a
sandbox start needs (`room()`), bounded by admission like every start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from host.contract import NetworkConfig, SnapshotRef
from host.tasks import cancel_and_wait

from . import ids
from .errors import CapacityExceeded
from .opcontext import Context

log = logging.getLogger(__name__)

DEFAULT_NETWORK = NetworkConfig()


def default_policy(network: NetworkConfig) -> bool:
    """Whether `network` asks for nothing a warm VM's network does not already have."""
    return (network.allow_internet_access == DEFAULT_NETWORK.allow_internet_access
            and not network.allow_out and not network.deny_out)


class WarmPool:
    def __init__(self, ctx: Context, size: int, *, room: Callable[[int], bool]) -> None:
        self.ctx = ctx
        self.size = size
        self.room = room                        # room(memory_mb): a start fits now
        self.ready: list[str] = []              # sandbox ids of held VMs of `source`
        self.source: SnapshotRef | None = None  # the template they were restored from
        self._fill: asyncio.Task[None] | None = None
        self._closed = False

    def take(self, ref: SnapshotRef, network: NetworkConfig) -> str | None:
        """The id of a warm VM of `ref` for a create (continue it with runtime.start of
        that id), or None; either way the pool refills for `ref` in the background."""
        if self.size <= 0 or self._closed or not default_policy(network):
            return None
        sid = None
        if self.source is not None and self.source.snapshot_id == ref.snapshot_id:
            sid = self.ready.pop(0) if self.ready else None
        else:
            self._retire()
            self.source = ref
        self._kick()
        return sid

    async def drain(self) -> int:
        """Release every warm VM (memory pressure, shutdown); how many were released."""
        await cancel_and_wait(self._fill)
        self._fill = None
        gone, self.ready = self.ready, []
        for sid in gone:
            await self._release(sid)
        return len(gone)

    async def aclose(self) -> None:
        self._closed = True
        await self.drain()

    # ---- internals ---------------------------------------------------------------------

    def _retire(self) -> None:
        """Another template's turn: its warm VMs go (in the background)."""
        gone, self.ready = self.ready, []
        for sid in gone:
            with contextlib.suppress(Exception):
                self.ctx.spawn(self._release(sid))

    def _kick(self) -> None:
        if self._fill is None or self._fill.done():
            with contextlib.suppress(Exception):  # shutting down
                self._fill = self.ctx.spawn(self._refill())

    async def _refill(self) -> None:
        while not self._closed and self.source is not None and len(self.ready) < self.size:
            ref = self.source
            mem = ref.machine.memory_mb
            if not self.room(mem):
                log.debug("warm pool: no room for another warm VM now")
                return
            sid = ids.new_sandbox_id()
            try:
                async with self.ctx.admission.start(sid, mem, self.ctx.vm_holders):
                    await self.ctx.runtime.start(sid, ref, DEFAULT_NETWORK, hold=True)
            except CapacityExceeded:
                return
            except asyncio.CancelledError:
                await asyncio.shield(self._release(sid))
                raise
            except Exception as exc:  # noqa: BLE001 - creates go the usual way meanwhile
                log.warning("warm pool: restoring a warm VM of %s failed: %s",
                            ref.snapshot_id, exc)
                await self._release(sid)
                return
            if self._closed or self.source is not ref:
                await self._release(sid)
                return
            self.ready.append(sid)

    async def _release(self, sid: str) -> None:
        try:
            await self.ctx.runtime.kill(sid)
        except Exception as exc:  # noqa: BLE001 - recovery reaps it at the next start
            log.warning("warm pool: releasing warm VM %s failed: %s", sid, exc)
