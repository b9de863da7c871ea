"""`POST /sandboxes/{sandboxID}/terminal`: a short-lived signed link to the sandbox's web
terminal (an aenv extension; the page itself is served by the proxy, host/web).

The link's base is the proxy's public URL (`app.state.terminal_base_url`, from the
service's config); the token opens only this sandbox's terminal, until it expires.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from host.web.links import DEFAULT_TTL_S, MAX_TTL_S, TerminalLinks

from . import models as m
from .errors import ApiError
from .sandboxes import orch, reply, sandbox_id


class TerminalLinkRequest(m.RequestModel):
    ttl: Annotated[int, Field(ge=10, le=MAX_TTL_S, description="Seconds the link is valid")] = (
        DEFAULT_TTL_S)


class TerminalLink(m.WireModel):
    url: str
    expires_at: datetime = Field(alias="expiresAt")


async def create_link(request: Request, *, body: TerminalLinkRequest) -> Response:
    links: TerminalLinks | None = getattr(request.app.state, "terminal_links", None)
    base: str | None = getattr(request.app.state, "terminal_base_url", None)
    if links is None or base is None:
        raise ApiError(404, "the web terminal is not enabled on this service")
    sid = sandbox_id(request)
    await orch(request).get(sid)  # 404 for an unknown sandbox
    token, expires = links.token(sid, body.ttl)
    return reply(TerminalLink(url=f"{base.rstrip('/')}/terminal/{sid}?token={token}",
                              expiresAt=datetime.fromtimestamp(expires, UTC)), 201)
