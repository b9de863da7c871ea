"""Let streaming handlers notice a client that went away while they were blocked (P4).

connectrpc only checks for `http.disconnect` between yielded messages; a handler waiting
on a quiet process never yields, so it would never learn that its client left.
`DisconnectMiddleware` wraps `receive` and sets a per-request event (exposed through a
ContextVar) when it sees `http.disconnect`; `next_or_disconnect` / `wait_or_disconnect`
race a wait against that event.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

_disconnected: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar(
    "envd_client_disconnected", default=None
)


class ClientDisconnected(Exception):
    """The HTTP client of the current request disconnected."""


class DisconnectMiddleware:
    """ASGI middleware that records client disconnects for streaming handlers."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        event = asyncio.Event()

        async def watched_receive() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect":
                event.set()
            return message

        token = _disconnected.set(event)
        try:
            await self.app(scope, watched_receive, send)
        finally:
            _disconnected.reset(token)


def disconnect_event() -> asyncio.Event | None:
    """The current request's disconnect event (None outside DisconnectMiddleware)."""
    return _disconnected.get()


def client_disconnected() -> bool:
    event = _disconnected.get()
    return event is not None and event.is_set()


async def wait_or_disconnect(aw: Awaitable[T], *, timeout_s: float | None = None) -> T:
    """Await `aw`, but give up when the client disconnects or `timeout_s` passes.

    Raises ClientDisconnected or TimeoutError; `aw` is cancelled in both cases, so it
    must be cancel-safe (a queue get, an event wait, a future).
    """
    event = _disconnected.get()
    if event is not None and event.is_set():
        if asyncio.iscoroutine(aw):
            aw.close()
        raise ClientDisconnected()
    work = asyncio.ensure_future(aw)
    if event is None:
        waiters: set[asyncio.Future[Any]] = {work}
        gone = None
    else:
        gone = asyncio.ensure_future(event.wait())
        waiters = {work, gone}
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        if gone is not None:
            gone.cancel()
    if work in done:
        return work.result()
    work.cancel()
    try:
        await work
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    if gone is not None and gone in done:
        raise ClientDisconnected()
    raise TimeoutError()


async def next_or_disconnect(it: AsyncIterator[T], *, timeout_s: float | None = None) -> T:
    """The next item of `it` (StopAsyncIteration at its end), or ClientDisconnected.

    Only use `timeout_s` with a cancel-safe iterator: a cancelled async generator is closed.
    """
    return await wait_or_disconnect(anext(it), timeout_s=timeout_s)


__all__ = [
    "ClientDisconnected",
    "DisconnectMiddleware",
    "client_disconnected",
    "disconnect_event",
    "next_or_disconnect",
    "wait_or_disconnect",
]
