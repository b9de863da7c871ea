"""Stream plumbing for WatchDir: keepalive interval and client-disconnect awareness.

connectrpc notices a client disconnect only between yields (notes P4); an idle
watch must learn it while blocked. `envd.rpc` owns the disconnect middleware; when
it exports a waiter we use it, otherwise keepalives bound how long an abandoned
stream lives.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from connectrpc.request import RequestContext

from ... import rpc

T = TypeVar("T")

# Upstream envd's interval when the client sends no Keepalive-Ping-Interval.
DEFAULT_KEEPALIVE_S = 90.0
MIN_KEEPALIVE_S = 0.05


def keepalive_interval_s(ctx: RequestContext) -> float:
    raw = ctx.request_headers.get("keepalive-ping-interval")
    try:
        value = float(raw) if raw else DEFAULT_KEEPALIVE_S
    except ValueError:
        value = DEFAULT_KEEPALIVE_S
    return max(value, MIN_KEEPALIVE_S) if value > 0 else DEFAULT_KEEPALIVE_S


def _disconnect_waiter() -> Any:
    """An awaitable that completes when the current request's client disconnects, or None."""
    wait = getattr(rpc, "wait_disconnected", None)
    if wait is None:
        return None
    return wait()


async def next_or_disconnect(aw: Awaitable[T]) -> T | None:
    """Await `aw`; None (and `aw` cancelled) if the client disconnects first."""
    gone = _disconnect_waiter()
    if gone is None:
        return await aw
    task = asyncio.ensure_future(aw)
    gone_task = asyncio.ensure_future(gone)
    try:
        done, _ = await asyncio.wait({task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone_task):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    if task in done:
        return task.result()
    return None
