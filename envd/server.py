"""uvicorn's server without its 10 Hz tick, and the Date header it used to refresh.

uvicorn's `Server.main_loop` wakes every 100 ms to check for shutdown and refresh the
Date header. In a microVM that wake-up is the guest's main idle cost: under TCG every
timer interrupt, scheduler pass and Python bytecode is emulated, and an idle sandbox
should cost the host close to nothing. Here the main loop sleeps on an event that the
shutdown signal sets, and `DateHeader` stamps each response instead (what Go's net/http,
and so upstream envd, sends). uvicorn offers no option for this; the override is the
two documented hooks `main_loop` and `handle_exit`.
"""

from __future__ import annotations

import asyncio
from email.utils import formatdate
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class QuietServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        if await self.on_tick(0):  # sets the default headers once; exits if asked already
            return
        await self._exit.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._exit.set)


class DateHeader:
    """Adds `date` to every HTTP response (uvicorn's own is off: it was the tick's job)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"date", formatdate(usegmt=True).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, stamped)


def serve(app: Any, *, host: str, port: int, **options: Any) -> None:
    config = uvicorn.Config(DateHeader(app), host=host, port=port, date_header=False,
                            **options)
    QuietServer(config).run()
