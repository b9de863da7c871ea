"""Handlers of the sandbox endpoints (spec §3.2, current and legacy).

Each handler gets its request already validated into the models the route table declares
(routes.py), maps them to orchestrator values (convert.py), calls one orchestrator method
and answers with a model. Errors propagate to the dispatcher, which maps them through
errors.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from host.orchestrator import Orchestrator
from host.orchestrator.model import ListFilter, SandboxInfo

from . import convert
from . import models as m
from .errors import ApiError
from .types import encode_cursor


def orch(request: Request) -> Orchestrator:
    return request.app.state.orchestrator  # type: ignore[no-any-return]


def domain(request: Request) -> str | None:
    return request.app.state.domain or getattr(orch(request), "domain", None)


def sandbox_id(request: Request) -> str:
    return str(request.path_params["sandboxID"])


def no_content() -> Response:
    return Response(status_code=204)


def reply(body: m.WireModel | Sequence[m.WireModel], status_code: int = 200,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """A model (or a JSON array of models) as the response body."""
    content = body.wire() if isinstance(body, m.WireModel) else [b.wire() for b in body]
    return JSONResponse(content, status_code=status_code, headers=headers)


# --- create / list / get / kill -------------------------------------------------------

async def create_v2(request: Request, *, body: m.NewSandboxV2,
                    headers: m.CreateHeaders) -> Response:
    req = convert.create_request(body, idempotency_key=headers.idempotency_key)
    info = await orch(request).create(req)
    return reply(convert.sandbox(info, domain(request)), 201)


async def create_v1(request: Request, *, body: m.NewSandbox) -> Response:
    info = await orch(request).create(convert.create_request(body))
    return reply(convert.sandbox(info, domain(request), with_token=body.secure), 201)


def _sorted_page(items: Sequence[SandboxInfo], *, desc: bool, limit: int,
                 cursor: tuple[float, str] | None) -> tuple[list[SandboxInfo], str | None]:
    """Order by startedAt (ties by id), resume after the cursor, cut at `limit`."""
    ordered = sorted(items, key=lambda i: (i.started_at, i.sandbox_id), reverse=desc)
    if cursor is not None:
        if desc:
            ordered = [i for i in ordered if (i.started_at, i.sandbox_id) < cursor]
        else:
            ordered = [i for i in ordered if (i.started_at, i.sandbox_id) > cursor]
    page = ordered[:limit]
    more = len(ordered) > limit
    nxt = encode_cursor(page[-1].started_at, page[-1].sandbox_id) if more else None
    return page, nxt


async def list_v2(request: Request, *, query: m.ListSandboxesQuery) -> Response:
    items = convert.started_since(await orch(request).list(convert.list_filter(query)),
                                  query.started_after)
    page, nxt = _sorted_page(items, desc=query.order == "desc", limit=query.limit,
                             cursor=query.next_token)
    headers = {"X-Next-Token": nxt} if nxt else None
    return reply([convert.listed_sandbox(i) for i in page], headers=headers)


async def list_v1(request: Request, *, query: m.ListSandboxesV1Query) -> Response:
    flt = ListFilter(states=convert.states(["running"]), metadata=query.metadata)
    items = await orch(request).list(flt)
    items = sorted(items, key=lambda i: (i.started_at, i.sandbox_id), reverse=True)
    return reply([convert.listed_sandbox(i) for i in items])


async def get_one(request: Request) -> Response:
    info = await orch(request).get(sandbox_id(request))
    return reply(convert.sandbox_detail(info, domain(request)))


async def kill(request: Request) -> Response:
    await orch(request).kill(sandbox_id(request))
    return no_content()


# --- lifecycle ------------------------------------------------------------------------

async def connect_v2(request: Request, *, body: m.ConnectSandboxV2) -> Response:
    # memory=false: on_resume="reboot"
    info, resumed = await orch(request).connect(sandbox_id(request), body.timeout,
                                                memory=body.memory)
    return reply(convert.sandbox(info, domain(request)), 201 if resumed else 200)


async def connect_v1(request: Request, *, body: m.ConnectSandbox) -> Response:
    info, resumed = await orch(request).connect(sandbox_id(request), body.timeout,
                                                memory=body.memory)
    return reply(convert.sandbox(info, domain(request)), 201 if resumed else 200)


async def resume_v1(request: Request, *, body: m.ResumedSandbox) -> Response:
    """Legacy beta resume: 409 when already running, else resume -> 201."""
    sid = sandbox_id(request)
    info = await orch(request).get(sid)
    if info.state.public == "running":
        raise ApiError(409, f"sandbox '{sid}' is already running")
    info, _ = await orch(request).connect(sid, body.timeout, memory=body.memory)
    return reply(convert.sandbox(info, domain(request)), 201)


async def pause(request: Request, *, body: m.SandboxPauseRequest) -> Response:
    await orch(request).pause(sandbox_id(request), memory=body.memory,
                              require_healthy=body.require_healthy_guest)
    return no_content()


async def set_timeout(request: Request, *, body: m.SandboxTimeoutRequest) -> Response:
    await orch(request).set_timeout(sandbox_id(request), body.timeout)
    return no_content()


async def refresh(request: Request, *, body: m.SandboxRefreshRequest) -> Response:
    await orch(request).extend_timeout(sandbox_id(request), body.duration)
    return no_content()


async def fork(request: Request, *, body: m.SandboxForkRequest) -> Response:
    results = await orch(request).fork(sandbox_id(request), body.count, body.timeout)
    dom = domain(request)
    return reply([convert.fork_result(r, dom) for r in results], 201)


async def update_network(request: Request, *, body: m.SandboxNetworkUpdateConfig) -> Response:
    sid = sandbox_id(request)
    current = await orch(request).get(sid)
    await orch(request).update_network(sid, convert.updated_network(body, current.network))
    return no_content()


# --- observability --------------------------------------------------------------------

async def metrics(request: Request, *, query: m.MetricsQuery) -> Response:
    items = await orch(request).metrics(sandbox_id(request))
    end = 2**62 if query.end is None else query.end
    return reply([convert.metric(x) for x in items if query.start <= x.timestamp <= end])


async def logs_v1(request: Request, *, query: m.LogsQuery) -> Response:
    lines = await orch(request).logs(sandbox_id(request), query.start or None, query.limit)
    return reply(m.SandboxLogs(logs=[convert.legacy_log(ln) for ln in lines],
                               logEntries=[convert.log_entry(ln) for ln in lines]))


_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}


async def logs_v2(request: Request, *, query: m.LogsV2Query) -> Response:
    forward = query.direction == "forward"
    cursor = query.cursor
    lines = list(await orch(request).logs(sandbox_id(request), cursor if forward else None,
                                          100_000))
    lines = [ln for ln in lines
             if _LEVELS.get(ln.level, 1) >= _LEVELS[query.level] and query.search in ln.line]
    if not forward:
        lines = [ln for ln in lines if not cursor or ln.timestamp * 1000 <= cursor][::-1]
    entries = [convert.log_entry(ln) for ln in lines[:query.limit]]
    return reply(m.SandboxLogsV2Response(logs=entries))
