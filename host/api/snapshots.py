"""Handlers of the snapshot endpoints: create, list (paginated), delete (as a template)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import parse, serialize
from .sandboxes import handler, no_content, orch, sandbox_id


@handler
async def create(request: Request) -> Response:
    body = await parse.json_body(request, required=False)
    name = parse.opt_str(body, "name")
    parse.opt_bool(body, "memory")
    info = await orch(request).snapshot(sandbox_id(request), name or None)
    return JSONResponse(serialize.snapshot(info), status_code=201)


@handler
async def list_all(request: Request) -> Response:
    q = request.query_params
    limit = parse.query_int(q.get("limit"), "limit", lo=1, hi=parse.MAX_LIST_LIMIT,
                            default=parse.MAX_LIST_LIMIT)
    cursor = parse.decode_cursor(q.get("nextToken"))
    items = await orch(request).list_snapshots(q.get("sandboxID") or None, q.get("name") or None)
    ordered = sorted(items, key=lambda s: (s.created_at, s.snapshot_id), reverse=True)
    if cursor is not None:
        ordered = [s for s in ordered if (s.created_at, s.snapshot_id) < cursor]
    page = ordered[:limit]
    headers = None
    if len(ordered) > limit:
        headers = {"X-Next-Token": parse.encode_cursor(page[-1].created_at, page[-1].snapshot_id)}
    return JSONResponse([serialize.snapshot(s) for s in page], headers=headers)


@handler
async def delete_template(request: Request) -> Response:
    # The route uses the `path` convertor: the server already decoded %2F and %3A, so
    # `team%2Fsnap%3Adefault` arrives here as `team/snap:default` (decoded after routing).
    template_id = str(request.path_params["template_id"])
    await orch(request).delete_snapshot(template_id)
    return no_content()
