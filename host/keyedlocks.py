"""One asyncio lock per key (a template id, a build queue), kept only while a task holds
or waits for it: a node that builds thousands of task templates over months must not keep
a lock for every id it ever saw."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}  # holders and waiters of each lock

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        """`async with locks.hold(key):` one task at a time per key."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            left = self._users[key] - 1
            if left:
                self._users[key] = left
            else:
                del self._users[key], self._locks[key]

    def busy(self, key: str) -> bool:
        """Whether a task holds the lock of `key` now."""
        lock = self._locks.get(key)
        return lock is not None and lock.locked()

    def __len__(self) -> int:
        return len(self._locks)
