"""Node endpoints the cluster's gateway calls (aenv extensions, behind the API key):
take over a paused sandbox another node left in the shared repository, drop this node's
copy of one taken over elsewhere (host/orchestrator/handoff.py), and say which sandbox of
this node signed a `/files` URL that names none (host/proxy/signed.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from host.orchestrator.model import ListFilter
from host.proxy.signed import SignedFileRequest

from . import convert
from . import models as m
from .errors import ApiError
from .sandboxes import domain, no_content, orch, reply, sandbox_id


class SignedFiles(m.RequestModel):
    """The signed parts of a `/files` URL, as envd reads them."""

    path: str
    operation: Literal["read", "write"]
    username: str = ""
    signature: str = Field(min_length=1)
    expiration: int | None = None


class Signer(m.WireModel):
    sandbox_id: str = Field(alias="sandboxID")


async def signer(request: Request, *, body: SignedFiles) -> Response:
    """200 with the id of this node's sandbox whose envd token made the signature; 404
    when none did. It identifies the sandbox only: envd checks the signature again."""
    signed = SignedFileRequest(path=body.path, operation=body.operation, user=body.username,
                               signature=body.signature, expiration=body.expiration)
    sid = signed.signer(await orch(request).list(ListFilter()))
    if sid is None:
        raise ApiError(404, "no sandbox of this node signed that URL")
    return reply(Signer.model_validate({"sandboxID": sid}))


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
