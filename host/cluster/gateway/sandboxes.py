"""The gateway's sandbox endpoints: create through the scheduler, every call on one sandbox
forwarded to the node holding it, and the index kept in step with what nodes answered.

    POST /v2/sandboxes, /sandboxes   the scheduler places it; a node that refuses with the
                                     capacity error (429), or cannot be reached before the
                                     request went out, is excluded and the next one tried;
                                     the created sandbox is bound to its node at once;
                                     with an `Idempotency-Key`, every create of that key
                                     goes to the node the first went to (a claim in Redis
                                     for 24 h), which answers the same sandbox
    /sandboxes/{id}/...              forwarded to its node (resolve.py); then
        DELETE                       unbound (also when the node no longer knew it)
        POST pause                   bound as paused
        POST connect / resume        bound as running; a sandbox paused on a dead node is
                                     adopted and resumed by another one (`resume_elsewhere`)
        POST fork                    the children bound to the parent's node

Requests that may have reached a node are never sent again (NodeUnreachable.sent); the
index changes never fail a request (the next heartbeat repairs the index).
"""

from __future__ import annotations

import logging
import secrets

from starlette.requests import Request
from starlette.responses import Response

from ..errors import (
    NodeUnreachable,
    SandboxLost,
    SandboxMoving,
    SandboxNotAdoptable,
    SandboxStranded,
    SandboxUnknown,
)
from ..registry import BindingState
from ..scheduler.service import Placement, PlacementRequest
from .forward import NodeAnswer
from .metrics import Stopwatch
from .resolve import Located
from .shared import GatewayContext, ctx_of

log = logging.getLogger(__name__)

MAX_CREATE_ATTEMPTS = 8
IDEMPOTENCY_MS = 24 * 3600_000   # how long a key sends its creates to one node
MOVE_CLAIM_MS = 600_000   # the longest an adopt + resume may take (TCG restores under load)


def target(request: Request) -> str:
    """The request's path (as sent, still percent-encoded) and query."""
    raw: bytes = request.scope.get("raw_path") or request.scope["path"].encode()
    query: bytes = request.scope.get("query_string", b"")
    return (raw + (b"?" + query if query else b"")).decode("latin-1")


def _action(method: str, rest: str) -> str | None:
    rest = rest.strip("/")
    if method == "DELETE" and not rest:
        return "kill"
    if method == "GET" and not rest:
        return "get"
    if method == "POST" and rest in ("connect", "resume", "pause", "fork"):
        return rest
    return None


# the operation group of a node call in the metrics (metrics.OPERATIONS), by action
_OPERATION = {"kill": "kill", "pause": "pause", "connect": "connect", "resume": "connect"}


async def _release(ctx: GatewayContext, placement: Placement, key: str | None = None) -> None:
    """Give back a placement that created nothing (and its claim of `key`)."""
    if placement.placement_id:
        await ctx.quietly("releasing a placement",
                          ctx.registry.release(placement.node_id, placement.placement_id))
    if key:
        await ctx.quietly("releasing an idempotency key",
                          ctx.registry.release_idempotency(key, placement.node_id))


async def _earlier_claim(ctx: GatewayContext, key: str, placement: Placement) -> Placement | None:
    """A create with an Idempotency-Key goes where the first create of that key went: that
    node answers with the same sandbox (or 409 for another body). `placement` when this is
    the first; None when the earlier node is dead (its claim is dropped)."""
    owner = await ctx.registry.claim_idempotency(key, placement.node_id, ttl_ms=IDEMPOTENCY_MS)
    if owner == placement.node_id:
        return placement
    await _release(ctx, placement)
    node = await ctx.registry.node(owner)
    if node is None or not node.alive:
        await ctx.registry.release_idempotency(key, owner)
        return None
    return Placement.on(node)


async def create(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await request.body()
    asked = Stopwatch()   # the time spent asking the scheduler, every attempt
    try:
        return await _create(ctx, request, body, asked)
    finally:
        ctx.metrics.placed("create", asked.seconds)


async def _create(ctx: GatewayContext, request: Request, body: bytes,
                  asked: Stopwatch) -> Response:
    key = request.headers.get("idempotency-key")
    excluded: list[str] = []
    for _ in range(MAX_CREATE_ATTEMPTS):
        with asked.running():
            placement = await ctx.scheduler.place(PlacementRequest(exclude=tuple(excluded)))
        if key:
            earlier = await _earlier_claim(ctx, key, placement)
            if earlier is None:   # its node died with the sandbox: the key is free again
                continue
            placement = earlier
        try:
            answer = await ctx.nodes.call(placement.address, "POST", target(request),
                                          body=body, headers=request.scope["headers"],
                                          operation="create")
        except NodeUnreachable as exc:
            await _release(ctx, placement, key)
            if exc.sent:
                raise
            excluded.append(placement.node_id)
            continue
        if answer.status == 429:   # the node's own admission refused: nothing was created
            await _release(ctx, placement, key)
            excluded.append(placement.node_id)
            continue
        if answer.status == 201:
            sid = str(answer.json().get("sandboxID", ""))
            await ctx.quietly(f"binding sandbox {sid}", ctx.registry.bind(
                sid, placement.node_id, BindingState.RUNNING,
                placement_id=placement.placement_id,
                used_delta=1 if placement.placement_id is not None else 0))
        else:
            await _release(ctx, placement)
        return ctx.answer(answer, sandboxes=True)
    raise NodeUnreachable(f"no node took the sandbox after {MAX_CREATE_ATTEMPTS} attempts "
                          f"(tried {', '.join(excluded)})", sent=False)


async def sandbox_call(request: Request) -> Response:
    ctx = ctx_of(request)
    sid = str(request.path_params["sandboxID"])
    action = _action(request.method, str(request.path_params.get("rest", "")))
    body = await request.body()
    try:
        loc = await ctx.resolver.locate(sid)
    except SandboxStranded as exc:
        if action in ("connect", "resume"):
            return await resume_elsewhere(request, sid, exc.node_id, body)
        raise
    except SandboxLost as exc:
        if action == "kill":   # as for any sandbox that is gone: the SDKs' kill() -> False
            raise SandboxUnknown(f"{exc.message}; there is nothing left to kill") from exc
        raise
    answer = await ctx.nodes.call(loc.node.address, request.method, target(request), body=body,
                                  headers=request.scope["headers"],
                                  operation=_OPERATION.get(action or "", "other"))
    await _bookkeep(ctx, action, sid, loc, answer)
    return ctx.answer(answer, sandboxes=action in ("get", "connect", "resume", "fork"))


async def _bookkeep(ctx: GatewayContext, action: str | None, sid: str, loc: Located,
                    answer: NodeAnswer) -> None:
    node_id, status, reg = loc.node.node_id, answer.status, ctx.registry
    if action == "kill" and status in (204, 404) or action == "get" and status == 404:
        await ctx.quietly(f"unbinding sandbox {sid}", reg.unbind(sid, node_id))
    elif action == "pause" and status == 204:
        await ctx.quietly(f"marking {sid} paused",
                          reg.set_state(sid, node_id, BindingState.PAUSED))
    elif action in ("connect", "resume") and status in (200, 201):
        if loc.binding.state is not BindingState.RUNNING:
            await ctx.quietly(f"marking {sid} running",
                              reg.set_state(sid, node_id, BindingState.RUNNING))
    elif action == "get" and status == 200:
        state = answer.json().get("state")
        if state in ("running", "paused") and state != loc.binding.state.value:
            await ctx.quietly(f"marking {sid} {state}",
                              reg.set_state(sid, node_id, BindingState(state)))
    elif action == "fork" and status == 201:
        for entry in answer.json():
            child = entry.get("sandbox") if isinstance(entry, dict) else None
            if isinstance(child, dict) and child.get("sandboxID"):
                await ctx.quietly(f"binding fork {child['sandboxID']}", reg.bind(
                    str(child["sandboxID"]), node_id, BindingState.RUNNING, used_delta=1))


async def resume_elsewhere(request: Request, sid: str, dead_node: str, body: bytes) -> Response:
    """Resume a sandbox paused on a dead node on another node. The scheduler picks the
    node; it adopts the sandbox from the shared repository (`POST /cluster/sandboxes/{id}/
    adopt`: the records its old node left there when it paused, host/orchestrator/
    handoff.py), then the client's connect resumes it there. One gateway moves a sandbox
    at a time (a claim in Redis); a concurrent connect gets a retryable 409."""
    ctx = ctx_of(request)
    owner = secrets.token_hex(8)
    if not await ctx.registry.claim_move(sid, owner, ttl_ms=MOVE_CLAIM_MS):
        raise SandboxMoving(f"sandbox '{sid}' is being resumed on another node right now; "
                            "retry in a moment")
    try:
        return await _move_and_resume(request, ctx, sid, dead_node, body)
    finally:
        await ctx.quietly(f"ending the move of {sid}", ctx.registry.end_move(sid, owner))


async def _move_and_resume(request: Request, ctx: GatewayContext, sid: str, dead_node: str,
                           body: bytes) -> Response:
    asked = Stopwatch()
    try:
        with asked.running():
            placement = await ctx.scheduler.place(PlacementRequest(kind="resume",
                                                                   sandbox_id=sid))
    finally:
        ctx.metrics.placed("resume", asked.seconds)
    try:
        adopted = await ctx.nodes.call(placement.address, "POST",
                                       f"/cluster/sandboxes/{sid}/adopt", operation="connect")
        if adopted.status != 201:
            await _release(ctx, placement)
            if adopted.status == 404:
                raise SandboxNotAdoptable(
                    f"sandbox '{sid}' is paused on node {dead_node}, which stopped "
                    f"heartbeating, and that node left no handoff of it in the shared "
                    "repository (it paused before the node joined the cluster, or the "
                    "nodes do not share one repository): it can resume only there")
            return adopted.response()
        # node B holds the sandbox (paused) from here on, whatever the resume does
        await ctx.quietly(f"binding adopted sandbox {sid}", ctx.registry.bind(
            sid, placement.node_id, BindingState.PAUSED,
            placement_id=placement.placement_id, used_delta=1))
        answer = await ctx.nodes.call(placement.address, "POST", target(request), body=body,
                                      headers=request.scope["headers"], operation="connect")
    except BaseException:
        await _release(ctx, placement)
        raise
    if answer.status in (200, 201):
        await ctx.quietly(f"marking {sid} running on {placement.node_id}",
                          ctx.registry.set_state(sid, placement.node_id,
                                                 BindingState.RUNNING))
        log.info("sandbox %s: paused on dead node %s, resumed on node %s", sid, dead_node,
                 placement.node_id)
        return ctx.answer(answer, sandboxes=True)
    return answer.response()
