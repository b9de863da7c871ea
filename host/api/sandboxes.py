"""Handlers of the sandbox endpoints (spec §3.2, current and legacy).

Each handler: parse into model values (parse.py), call one orchestrator method, serialize
(serialize.py). Errors propagate to `handler`, which maps them through errors.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from host.orchestrator.model import ListFilter, SandboxInfo
from host.orchestrator.service import Orchestrator

from . import parse, serialize
from .errors import ApiError, bad_request, response_for

Handler = Callable[[Request], Awaitable[Response]]
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


def handler(fn: Handler) -> Handler:
    """Wrap an endpoint so that every exception leaves as an E2B error body."""

    @functools.wraps(fn)
    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as exc:  # noqa: BLE001 - the edge: map everything, cancel passes
            return response_for(exc)

    return wrapped


def orch(request: Request) -> Orchestrator:
    return request.app.state.orchestrator  # type: ignore[no-any-return]


def domain(request: Request) -> str | None:
    return request.app.state.domain or getattr(orch(request), "domain", None)


def sandbox_id(request: Request) -> str:
    return str(request.path_params["sandbox_id"])


def no_content() -> Response:
    return Response(status_code=204)


# --- create / list / get / kill -------------------------------------------------------

@handler
async def create_v2(request: Request) -> Response:
    key = request.headers.get("idempotency-key")
    if key is not None and not _IDEMPOTENCY_KEY.match(key):
        raise bad_request("'Idempotency-Key' must be 1-255 visible ASCII characters")
    req = parse.create_request(await parse.json_body(request), legacy=False, idempotency_key=key)
    info = await orch(request).create(req)
    return JSONResponse(serialize.sandbox(info, domain(request)), status_code=201)


@handler
async def create_v1(request: Request) -> Response:
    req = parse.create_request(await parse.json_body(request), legacy=True)
    info = await orch(request).create(req)
    body = serialize.sandbox(info, domain(request), with_token=req.secure)
    return JSONResponse(body, status_code=201)


def _sorted_page(items: Sequence[SandboxInfo], *, desc: bool, limit: int,
                 token: str | None) -> tuple[list[SandboxInfo], str | None]:
    """Order by startedAt (ties by id), resume after the cursor, cut at `limit`."""
    ordered = sorted(items, key=lambda i: (i.started_at, i.sandbox_id), reverse=desc)
    cursor = parse.decode_cursor(token)
    if cursor is not None:
        if desc:
            ordered = [i for i in ordered if (i.started_at, i.sandbox_id) < cursor]
        else:
            ordered = [i for i in ordered if (i.started_at, i.sandbox_id) > cursor]
    page = ordered[:limit]
    more = len(ordered) > limit
    nxt = parse.encode_cursor(page[-1].started_at, page[-1].sandbox_id) if more else None
    return page, nxt


@handler
async def list_v2(request: Request) -> Response:
    q = request.query_params
    flt = ListFilter(
        states=parse.states_filter(q.get("state")),
        metadata=parse.metadata_filter(q.get("metadata")),
        template=q.get("template") or None,
        started_after=parse.rfc3339(q.get("startedAfter"), "startedAfter"),
    )
    desc = parse.order(q.get("order"))
    limit = parse.query_int(q.get("limit"), "limit", lo=1, hi=parse.MAX_LIST_LIMIT,
                            default=parse.MAX_LIST_LIMIT)
    items = await orch(request).list(flt)
    page, nxt = _sorted_page(items, desc=desc, limit=limit, token=q.get("nextToken"))
    headers = {"X-Next-Token": nxt} if nxt else None
    return JSONResponse([serialize.listed_sandbox(i) for i in page], headers=headers)


@handler
async def list_v1(request: Request) -> Response:
    flt = ListFilter(states=parse.states_filter("running"),
                     metadata=parse.metadata_filter(request.query_params.get("metadata")))
    items = await orch(request).list(flt)
    items = sorted(items, key=lambda i: (i.started_at, i.sandbox_id), reverse=True)
    return JSONResponse([serialize.listed_sandbox(i) for i in items])


@handler
async def get_one(request: Request) -> Response:
    info = await orch(request).get(sandbox_id(request))
    return JSONResponse(serialize.sandbox_detail(info, domain(request)))


@handler
async def kill(request: Request) -> Response:
    await orch(request).kill(sandbox_id(request))
    return no_content()


# --- lifecycle ------------------------------------------------------------------------

@handler
async def connect_v2(request: Request) -> Response:
    body = await parse.json_body(request, required=False)
    memory = parse.opt_bool(body, "memory", True)  # false: on_resume="reboot"
    info, resumed = await orch(request).connect(sandbox_id(request), parse.opt_int(body, "timeout"),
                                                memory=bool(memory))
    return JSONResponse(serialize.sandbox(info, domain(request)), status_code=201 if resumed else 200)


@handler
async def connect_v1(request: Request) -> Response:
    body = await parse.json_body(request)
    timeout = parse.req_int(body, "timeout")
    memory = parse.opt_bool(body, "memory", True)
    info, resumed = await orch(request).connect(sandbox_id(request), timeout,
                                                memory=bool(memory))
    return JSONResponse(serialize.sandbox(info, domain(request)), status_code=201 if resumed else 200)


@handler
async def resume_v1(request: Request) -> Response:
    """Legacy beta resume: 409 when already running, else resume -> 201."""
    body = await parse.json_body(request, required=False)
    timeout = parse.opt_int(body, "timeout", default=15)
    parse.opt_bool(body, "autoPause")
    memory = parse.opt_bool(body, "memory", True)
    sid = sandbox_id(request)
    info = await orch(request).get(sid)
    if info.state.public == "running":
        raise ApiError(409, f"sandbox '{sid}' is already running")
    info, _ = await orch(request).connect(sid, timeout, memory=bool(memory))
    return JSONResponse(serialize.sandbox(info, domain(request)), status_code=201)


@handler
async def pause(request: Request) -> Response:
    body = await parse.json_body(request, required=False)
    memory = parse.opt_bool(body, "memory", True)
    strict = parse.opt_bool(body, "requireHealthyGuest", False)
    await orch(request).pause(sandbox_id(request), memory=bool(memory),
                              require_healthy=bool(strict))
    return no_content()


@handler
async def set_timeout(request: Request) -> Response:
    timeout = parse.req_int(await parse.json_body(request), "timeout")
    await orch(request).set_timeout(sandbox_id(request), timeout)
    return no_content()


@handler
async def refresh(request: Request) -> Response:
    body = await parse.json_body(request, required=False)
    duration = parse.opt_int(body, "duration", lo=0, hi=3600, default=0) or 0
    await orch(request).extend_timeout(sandbox_id(request), duration)
    return no_content()


@handler
async def fork(request: Request) -> Response:
    count, timeout = parse.fork_params(await parse.json_body(request, required=False))
    results = await orch(request).fork(sandbox_id(request), count, timeout)
    dom = domain(request)
    return JSONResponse([serialize.fork_result(r, dom) for r in results], status_code=201)


@handler
async def update_network(request: Request) -> Response:
    body = await parse.json_body(request)
    sid = sandbox_id(request)
    current = await orch(request).get(sid)
    # PUT replaces the egress config only; ingress settings (public traffic, host mask,
    # httpsPorts) stay as they were.
    net = parse.network_config(body, allow_internet_access=parse.opt_bool(
        body, "allow_internet_access"), base=current.network)
    kept = {k: v for k, v in current.network.extra.items() if k == "httpsPorts"}
    net = dataclasses.replace(net, extra={**kept, **net.extra})
    await orch(request).update_network(sid, net)
    return no_content()


# --- observability --------------------------------------------------------------------

@handler
async def metrics(request: Request) -> Response:
    q = request.query_params
    start = parse.query_int(q.get("start"), "start", lo=0, hi=parse.INT64_MAX, default=0)
    end = parse.query_int(q.get("end"), "end", lo=0, hi=parse.INT64_MAX, default=2**62)
    items = await orch(request).metrics(sandbox_id(request))
    return JSONResponse([serialize.metric(m) for m in items if start <= m.timestamp <= end])


@handler
async def logs_v1(request: Request) -> Response:
    q = request.query_params
    start = parse.query_int(q.get("start"), "start", lo=0, hi=parse.INT64_MAX, default=0)
    limit = parse.query_int(q.get("limit"), "limit", lo=0, hi=10_000, default=1000)
    lines = await orch(request).logs(sandbox_id(request), start or None, limit)
    return JSONResponse({"logs": [serialize.legacy_log(ln) for ln in lines],
                         "logEntries": [serialize.log_entry(ln) for ln in lines]})


_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}


@handler
async def logs_v2(request: Request) -> Response:
    q = request.query_params
    cursor = parse.query_int(q.get("cursor"), "cursor", lo=0, hi=parse.INT64_MAX, default=0)
    limit = parse.query_int(q.get("limit"), "limit", lo=0, hi=1000, default=1000)
    direction = q.get("direction") or "forward"
    if direction not in ("forward", "backward"):
        raise bad_request(f"'direction' must be 'forward' or 'backward', got {direction!r}")
    level = q.get("level") or "debug"
    if level not in _LEVELS:
        raise bad_request(f"'level' must be one of {sorted(_LEVELS)}, got {level!r}")
    search = q.get("search") or ""
    forward = direction == "forward"
    lines: Any = await orch(request).logs(sandbox_id(request), cursor if forward else None, 100_000)
    lines = [ln for ln in lines if _LEVELS.get(ln.level, 1) >= _LEVELS[level] and search in ln.line]
    if not forward:
        lines = [ln for ln in lines if not cursor or ln.timestamp * 1000 <= cursor][::-1]
    return JSONResponse({"logs": [serialize.log_entry(ln) for ln in lines[:limit]]})
