"""Node endpoints the cluster's gateway calls (aenv extensions, behind the API key):
take over a paused sandbox another node left in the shared repository, and drop this
node's copy of one taken over elsewhere (host/orchestrator/handoff.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from . import convert
from .errors import ApiError
from .sandboxes import domain, no_content, orch, reply, sandbox_id


async def adopt(request: Request) -> Response:
    """201 with the sandbox (paused) once this node holds it; 404 when no node left it."""
    info = await orch(request).adopt(sandbox_id(request))
    return reply(convert.sandbox_detail(info, domain(request)), 201)


async def forget(request: Request) -> Response:
    """204 once this node no longer holds the paused sandbox; 409 when it holds it in
    another state (running here: it was not taken over)."""
    sid = sandbox_id(request)
    if not await orch(request).forget(sid):
        info = await orch(request).get(sid)  # 404 when this node never had it
        raise ApiError(409, f"sandbox '{sid}' is {info.state.value} on this node, not paused")
    return no_content()
