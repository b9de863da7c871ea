"""Disk chains stay short: a sandbox's own layers merged into one, in the background.

Every pause seals the sandbox's disk upper into a layer. Past `max_disk_chain` own layers
(those above what the sandbox started from: its template's or its fork source's, which
other stacks share and which are never copied), the block server merges them into one
and swaps it in under the live upper (`BlockServer.compact`); the next pause's manifest
then names the short chain, so a resume opens a bounded number of layers, and the old
layers, once no manifest names them, are collected.

Requests come after a start (a resume restores the chain its manifest names) and after a
snapshot the VM goes on from (a live snapshot, a pause that keeps its VM). One worker,
owned by the runtime, runs them one at a time: a merge copies data, and a burst of them
must not take the node's disk from the guests.
"""

from __future__ import annotations

import asyncio
import logging
import time

from host.storage.errors import StorageError
from host.tasks import cancel_and_wait

from .blockd import BlockServerHandle
from .sandbox import RunningSandbox

log = logging.getLogger(__name__)


class Compactor:
    def __init__(self, block: BlockServerHandle, max_disk_chain: int) -> None:
        self.block = block
        self.bound = max_disk_chain
        self._wanted: dict[str, int] = {}  # stack -> index of its first own layer
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def request(self, sb: RunningSandbox) -> None:
        """Look at `sb`'s stack soon; merge its own layers if there are too many."""
        if self.bound <= 0 or sb.disk_base is None:
            return
        self._wanted[sb.stack] = sb.disk_base
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="compactor")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._wanted:
                stack = next(iter(self._wanted))
                start = self._wanted.pop(stack)
                try:
                    await self._one(stack, start)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a later request tries again
                    log.warning("stack %s: compaction failed: %s", stack, exc)

    async def _one(self, stack: str, start: int) -> None:
        client = self.block.client
        try:
            info = await client.info(stack)
        except StorageError:  # gone meanwhile (killed, paused without its VM)
            return
        if len(info.layers) - start <= self.bound:
            return
        t0 = time.perf_counter()
        out = await client.compact(stack, start)
        if out.get("digest"):
            log.info("stack %s: %d own layers merged into one in %.0f ms (%d layers now)",
                     stack, out["merged"], (time.perf_counter() - t0) * 1e3, out["layers"])

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self._wanted.clear()
