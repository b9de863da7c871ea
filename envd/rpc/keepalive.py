"""Application-level keepalives for server streams (P6).

The SDKs send `Keepalive-Ping-Interval: <seconds>` on Start/Connect/WatchDir; while a
stream is idle the server emits a keepalive message every interval (the timer restarts
on every data message). The handler yields its mandatory first message itself, before
wrapping the rest of the stream, so a keepalive never precedes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from connectrpc.request import RequestContext

from .disconnect import disconnect_event

T = TypeVar("T")

KEEPALIVE_HEADER = "keepalive-ping-interval"
DEFAULT_KEEPALIVE_S = 90.0


def keepalive_interval_s(ctx: RequestContext[Any, Any],
                         default_s: float = DEFAULT_KEEPALIVE_S) -> float:
    """The stream's keepalive interval: the request header if valid and positive, else default."""
    raw = ctx.request_headers.get(KEEPALIVE_HEADER)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            return default_s
        if value > 0:
            return value
    return default_s


async def with_keepalive(source: AsyncIterator[T], *, interval_s: float,
                         keepalive: Callable[[], T]) -> AsyncIterator[T]:
    """Yield `source`'s items, plus `keepalive()` after every `interval_s` of silence.

    Ends quietly when the client disconnects (DisconnectMiddleware) or `source` ends.
    `source` is advanced by one long-lived pending `anext`, so it is never cancelled
    mid-item by a keepalive tick; it is closed when this generator ends.
    """
    event = disconnect_event()
    gone = asyncio.ensure_future(event.wait()) if event is not None else None
    pending: asyncio.Future[T] | None = None
    try:
        deadline = time.monotonic() + interval_s
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            waiters: set[asyncio.Future[Any]] = {pending}
            if gone is not None:
                waiters.add(gone)
            done, _ = await asyncio.wait(waiters, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if pending in done:
                finished, pending = pending, None
                try:
                    item = finished.result()
                except StopAsyncIteration:
                    return
                yield item
                deadline = time.monotonic() + interval_s
            elif gone is not None and gone in done:
                return
            else:
                yield keepalive()
                deadline = time.monotonic() + interval_s
    finally:
        if gone is not None:
            gone.cancel()
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


__all__ = ["DEFAULT_KEEPALIVE_S", "keepalive_interval_s", "with_keepalive"]
