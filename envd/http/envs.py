"""GET /envs: the sandbox-wide environment variables set by /init."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..state import Defaults
from .errors import Endpoint


def envs_endpoint(defaults: Defaults) -> Endpoint:
    async def envs(request: Request) -> Response:
        return JSONResponse(dict(defaults.env_vars))

    return envs
