"""process.Process: start, attach to, feed and signal processes (with PTYs)."""

from __future__ import annotations

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from ...spec.process.process_connect import Process
from ...state import Defaults


class ProcessService(Process):
    def __init__(self, defaults: Defaults) -> None:
        self.defaults = defaults

    def terminal_route(self) -> BaseRoute:
        async def terminal(ws: WebSocket) -> None:
            await ws.close(code=1011)

        return WebSocketRoute("/terminal", terminal)

    async def aclose(self) -> None:
        pass


__all__ = ["ProcessService"]
