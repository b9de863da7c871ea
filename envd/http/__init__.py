"""envd's plain HTTP routes: /health, /files, /init, /envs, /metrics."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..config import EnvdConfig
from ..state import Defaults


def routes(defaults: Defaults, config: EnvdConfig) -> list[BaseRoute]:
    async def health(request: Request) -> Response:
        return Response(status_code=204)

    return [Route("/health", health, methods=["GET"])]


__all__ = ["routes"]
