"""Handlers of the snapshot endpoints: create, list (paginated). Deleting one is
DELETE /templates/{id} (templates.py), as the SDKs do it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from . import convert
from . import models as m
from .sandboxes import orch, reply, sandbox_id
from .types import encode_cursor


async def create(request: Request, *, body: m.SandboxSnapshotRequest) -> Response:
    info = await orch(request).snapshot(sandbox_id(request), body.name or None)
    return reply(convert.snapshot(info), 201)


async def list_all(request: Request, *, query: m.ListSnapshotsQuery) -> Response:
    items = await orch(request).list_snapshots(query.sandbox_id, query.name)
    ordered = sorted(items, key=lambda s: (s.created_at, s.snapshot_id), reverse=True)
    if query.next_token is not None:
        cursor = query.next_token
        ordered = [s for s in ordered if (s.created_at, s.snapshot_id) < cursor]
    page = ordered[:query.limit]
    headers = None
    if len(ordered) > query.limit:
        headers = {"X-Next-Token": encode_cursor(page[-1].created_at, page[-1].snapshot_id)}
    return reply([convert.snapshot(s) for s in page], headers=headers)
