"""The CreateWatcher / GetWatcherEvents / RemoveWatcher trio (the sync Python SDK's
watches): a directory watch (watch.py) whose events wait, converted and bounded
(MAX_PENDING_EVENTS, oldest dropped), until the client polls them; watchers by id.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from ...spec.filesystem.filesystem_pb import FilesystemEvent
from .watch import MAX_PENDING_EVENTS, DirWatch


class PollingWatcher:
    """A DirWatch whose events are buffered until the client polls them (sync Py SDK).

    A pump converts events as they come (their entries stat-ed near the time of the
    change); a poll first takes in everything the kernel and the pump have queued, under
    the same lock, so that it returns every event of a change made before it, in order.
    """

    def __init__(self, watch: DirWatch) -> None:
        self.watch = watch
        self._events: list[FilesystemEvent] = []
        self._lock = asyncio.Lock()
        self._task = asyncio.create_task(self._pump(), name=f"watcher {watch.root}")

    async def _pump(self) -> None:
        while True:
            await self.watch.wait_queued()
            async with self._lock:
                await self._convert_queued()

    async def _convert_queued(self) -> None:
        while self.watch.pending():
            event = await self.watch.next_event()  # does not wait: one is queued
            if len(self._events) >= MAX_PENDING_EVENTS:
                del self._events[0]
            self._events.append(event)

    async def drain(self) -> list[FilesystemEvent]:
        """Events since the previous drain, including every one the kernel has queued."""
        async with self._lock:
            self.watch.read_kernel_queue()
            await self._convert_queued()
            events, self._events = self._events, []
        return events

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.watch.close()


class WatcherRegistry:
    """Watchers created by CreateWatcher, by id. `aclose()` stops them all."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._watchers: dict[str, PollingWatcher] = {}
        self._new_id = new_id

    def add(self, watch: DirWatch) -> str:
        watcher_id = self._new_id()
        self._watchers[watcher_id] = PollingWatcher(watch)
        return watcher_id

    def get(self, watcher_id: str) -> PollingWatcher | None:
        return self._watchers.get(watcher_id)

    async def remove(self, watcher_id: str) -> bool:
        watcher = self._watchers.pop(watcher_id, None)
        if watcher is None:
            return False
        await watcher.aclose()
        return True

    async def aclose(self) -> None:
        watchers, self._watchers = self._watchers, {}
        for watcher in watchers.values():
            await watcher.aclose()
