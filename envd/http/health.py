"""GET /health: 204 while envd serves (no auth; the SDKs' is_running() probe)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response


async def health(request: Request) -> Response:
    return Response(status_code=204)
