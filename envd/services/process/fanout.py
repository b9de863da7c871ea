"""Per-process output multiplexer: one publisher (the pipe/PTY pumps), many subscribers.

Each subscriber (a Start or Connect stream) has a bounded queue. A full queue applies
backpressure to the pumps (and so to the process, like a pipe), but only for
`stall_timeout_s`: a subscriber that stops reading for that long is dropped, so a
client that never reads cannot freeze the process forever. A subscriber that leaves
(stream closed, client disconnected) unsubscribes at once; with no subscribers, output
is discarded and the process runs freely.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

Item = TypeVar("Item")
End = TypeVar("End")

DEFAULT_QUEUE_ITEMS = 64
DEFAULT_STALL_TIMEOUT_S = 30.0


class SubscriberDropped(Exception):
    """The subscriber fell behind the process output for too long and was cut off."""


class Subscription(Generic[Item, End]):
    """One reader's view of a process's output: items in order, then the end value."""

    def __init__(self, fanout: Fanout[Item, End], max_items: int) -> None:
        self._fanout = fanout
        self._items: deque[Item] = deque()
        self._max_items = max_items
        self._end: End | None = None
        self._ended = False
        self._dropped = False
        self._closed = False
        self._changed = asyncio.Event()   # set when items/end arrive
        self._drained = asyncio.Event()   # set when there is room again
        self._drained.set()

    # -- publisher side -------------------------------------------------------
    def _full(self) -> bool:
        return len(self._items) >= self._max_items

    def _push(self, item: Item) -> None:
        self._items.append(item)
        if self._full():
            self._drained.clear()
        self._changed.set()

    def _finish(self, end: End | None, *, dropped: bool = False) -> None:
        self._end, self._ended, self._dropped = end, True, dropped
        self._drained.set()
        self._changed.set()

    # -- reader side ----------------------------------------------------------
    async def get(self) -> Item | End:
        """Next item, then the end value; raises StopAsyncIteration after it.

        Cancel-safe: a cancelled get loses nothing.
        """
        while True:
            if self._dropped:
                raise SubscriberDropped("output reader fell behind the process and was cut off")
            if self._items:
                item = self._items.popleft()
                if not self._full():
                    self._drained.set()
                return item
            if self._ended:
                if self._closed:
                    raise StopAsyncIteration
                self._closed = True
                self._fanout._unsubscribe(self)
                return self._end  # type: ignore[return-value]
            self._changed.clear()
            await self._changed.wait()

    async def __aiter__(self) -> AsyncIterator[Item | End]:
        try:
            while True:
                try:
                    yield await self.get()
                except StopAsyncIteration:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Stop receiving (idempotent); the publisher never waits on a closed subscriber."""
        self._closed = True
        self._drained.set()
        self._fanout._unsubscribe(self)


class Fanout(Generic[Item, End]):
    """Delivers every published item to every current subscriber, then one end value."""

    def __init__(self, *, queue_items: int = DEFAULT_QUEUE_ITEMS,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self._subs: list[Subscription[Item, End]] = []
        self._queue_items = queue_items
        self._stall_timeout_s = stall_timeout_s
        self._end: End | None = None
        self._ended = False

    @property
    def subscriber_count(self) -> int:
        return len(self._subs)

    def subscribe(self) -> Subscription[Item, End]:
        """A new subscriber that sees output from now on (just the end if already ended)."""
        sub: Subscription[Item, End] = Subscription(self, self._queue_items)
        if self._ended:
            sub._finish(self._end)
        else:
            self._subs.append(sub)
        return sub

    def _unsubscribe(self, sub: Subscription[Item, End]) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    async def publish(self, item: Item) -> None:
        """Queue `item` for every subscriber, waiting (bounded) while one is full."""
        for sub in list(self._subs):
            if sub._closed:
                continue
            if sub._full():
                try:
                    async with asyncio.timeout(self._stall_timeout_s):
                        while sub._full() and not sub._closed:
                            await sub._drained.wait()
                except TimeoutError:
                    self._unsubscribe(sub)
                    sub._finish(None, dropped=True)
                    continue
                if sub._closed:
                    continue
            sub._push(item)

    def close(self, end: End) -> None:
        """Publish the end value to every subscriber; later subscribers get it at once."""
        self._end, self._ended = end, True
        for sub in list(self._subs):
            sub._finish(end)


__all__ = ["Fanout", "SubscriberDropped", "Subscription"]
