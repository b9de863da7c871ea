"""Kept VMs: a paused sandbox's VM stays, stopped, for a while after its pause committed.

A pause is durable once its snapshot is committed; the VM is then only what makes a
resume fast. Restoring a snapshot spawns a VMM, builds a network and a disk stack and,
under TCG, makes the guest translate again every piece of code it runs (a resume's first
envd answer and first command cost ~300 ms more than on a VM that ran them before). So a
pause keeps its VM stopped (`runtime.snapshot(keep=True)`: its disk already writes over
the sealed layer, its memory is the snapshot's) for `keep_s` seconds, and a resume in
that window continues it: `runtime.start` of the same id and snapshot (the runtime's held
VMs, as for warm.py's). The memory a kept VM holds is a cache of the snapshot, given
back:

- when `keep_s` has passed since the pause (the expiry task, owned here);
- before anything else under memory pressure (pressure.py's `release_spare`), and when
  admission would refuse a start (admission.py's `spare`);
- when the sandbox is killed (the runtime's kill releases it), or resumed by a reboot;
- at shutdown; after a crash, recovery reaps it (its sandbox is paused: no VM expected).

Only pauses that keep memory are kept, only while the node keeps well clear of memory
pressure (`room`), never a pause made to free memory, and never on a node in a cluster
(another node may resume the sandbox from the shared repository).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from host.tasks import cancel_and_wait

from .opcontext import Context
from .states import SandboxState as S

log = logging.getLogger(__name__)


class KeptVms:
    def __init__(self, ctx: Context, keep_s: float, *, room: Callable[[int], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self.keep_s = keep_s
        self.room = room                       # room(memory_mb): a start fits now
        self.clock = clock
        self.until: dict[str, float] = {}      # sandbox id -> when its kept VM goes
        self._expiry: asyncio.Task[None] | None = None
        self._closed = False

    def admits(self, memory_mb: int) -> bool:
        """Whether a pause starting now may keep its VM."""
        return (self.keep_s > 0 and not self._closed and not self.ctx.handoff
                and self.room(memory_mb))

    def kept(self, sandbox_id: str) -> None:
        """The pause of `sandbox_id` committed and kept its VM."""
        self.until[sandbox_id] = self.clock() + self.keep_s
        if self._expiry is None or self._expiry.done():
            with contextlib.suppress(Exception):  # shutting down: aclose releases it
                self._expiry = self.ctx.spawn(self._expire())

    def take(self, sandbox_id: str) -> bool:
        """Forget `sandbox_id`'s kept VM (a resume continues it, a kill releases it); the
        caller holds the sandbox's lock. Whether there was one."""
        return self.until.pop(sandbox_id, None) is not None

    async def release(self, sandbox_id: str) -> bool:
        """Release `sandbox_id`'s kept VM unless an operation holds the sandbox (that
        resume or kill takes it); whether it was released."""
        if sandbox_id not in self.until or self.ctx.lock(sandbox_id).locked():
            return False
        async with self.ctx.lock(sandbox_id):
            if not self.take(sandbox_id):
                return False
            try:
                rec = await self.ctx.db(self.ctx.store.get_sandbox, sandbox_id)
                if rec.state is not S.PAUSED:  # resumed or killed meanwhile: not ours
                    return False
                await self.ctx.runtime.kill(sandbox_id)
            except Exception as exc:  # noqa: BLE001 - recovery reaps it at the next start
                log.warning("releasing the kept VM of paused sandbox %s failed: %s",
                            sandbox_id, exc)
                return False
        log.info("paused sandbox %s: its kept VM was released", sandbox_id)
        return True

    async def drain(self) -> int:
        """Release every kept VM no operation holds (memory pressure, a start admission
        would refuse, shutdown); how many were released."""
        released = 0
        for sid in sorted(self.until, key=self.until.__getitem__):  # oldest first
            released += await self.release(sid)
        return released

    async def aclose(self) -> None:
        self._closed = True
        await cancel_and_wait(self._expiry)
        self._expiry = None
        await self.drain()

    async def _expire(self) -> None:
        while self.until:
            now = self.clock()
            for sid, until in sorted(self.until.items(), key=lambda kv: kv[1]):
                if until > now:
                    break
                if not await self.release(sid) and sid in self.until:
                    self.until[sid] = now + 1.0  # held by an operation: look again later
            if self.until:
                await asyncio.sleep(max(0.05, min(self.until.values()) - self.clock()))
