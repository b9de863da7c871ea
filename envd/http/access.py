"""Access-token guard for envd's token-protected plain routes (/envs, /metrics)."""

from __future__ import annotations

import functools

from starlette.requests import Request
from starlette.responses import Response

from ..auth import AuthError, require_token
from ..state import Defaults
from .errors import Endpoint, json_error


def token_required(defaults: Defaults, endpoint: Endpoint) -> Endpoint:
    """401 JSON unless the request carries the current X-Access-Token (when one is set)."""

    @functools.wraps(endpoint)
    async def wrapper(request: Request) -> Response:
        try:
            require_token(defaults, request.headers.get("x-access-token"))
        except AuthError as exc:
            return json_error(401, str(exc))
        return await endpoint(request)

    return wrapper
