"""Templates through the gateway: built on one node, used on every node.

A template is built on one node, its *home*, which publishes it to the cluster's catalog
in the shared repository when a build turns ready (host/orchestrator/templates/catalog.py); every
other node imports it from there the first time a create, a `fromTemplate` or a lookup
names it. So creates need nothing from the gateway, and the template API goes to the home:

    POST /v3/templates                    the name's home while it is alive (a hint in the
                                          index), else the scheduler's pick; the hint is
                                          set from the answer (template id and name)
    GET /templates, /v2/templates         every live node's list, merged by templateID
    GET .../files/{hash}                  at the home; the upload URL is the gateway's
    PUT /template-files/{node}/{hash}     the COPY upload, streamed to the node that
                                          signed its URL (the signature is the node's)
    DELETE /templates/{id}                every live node, the home last; the first
                                          refusal stops it (a node with sandboxes from the
                                          template: its files must stay)
    anything else naming a template       the home (hint), else the live nodes in turn
                                          until one does not answer 404 (other nodes'
                                          copies answer 404 to changes: catalog.py)

A request that may have reached a node is not sent to another (`NodeUnreachable.sent`); a
404 is an answer that nothing happened there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from host.api import template_models as tm
from host.api.types import encode_cursor
from host.api.validation import validate
from host.orchestrator.templates.names import lookup_name

from ..errors import NodeUnreachable, SandboxUnknown
from ..registry import NodeRecord
from ..scheduler.service import PlacementRequest
from .forward import NodeAnswer
from .listing import gather, get_page, live_nodes, with_unreachable
from .sandboxes import target
from .shared import GatewayContext, ctx_of

log = logging.getLogger(__name__)

PAGE = 100


def _keys(ref: str) -> list[str]:
    """The index keys a template reference may be known by: itself, and its name."""
    name = lookup_name(ref)
    return [ref] if name is None or name.alias == ref else [ref, name.alias]


def _ref_of(path: str) -> str:
    """The template part of /templates/{ref}[/files/h | /builds/b[/status] | /tags]."""
    ref = path.split("/templates/", 1)[1]
    for marker in ("/files/", "/builds/"):
        if marker in ref:
            ref = ref.rsplit(marker, 1)[0]
    return ref.removesuffix("/tags")


async def _home(ctx: GatewayContext, ref: str) -> NodeRecord | None:
    for key in _keys(ref):
        node_id = await ctx.registry.template_home(key)
        if node_id:
            node = await ctx.registry.node(node_id)
            if node is not None and node.alive:
                return node
    return None


async def _ordered(ctx: GatewayContext, ref: str) -> list[NodeRecord]:
    """Live nodes, the template's home first."""
    home = await _home(ctx, ref)
    live = await ctx.registry.live_nodes()
    return ([home] if home else []) + [n for n in live if home is None or n.node_id != home.node_id]


async def _first_that_has(request: Request, ref: str, body: bytes = b"") -> tuple[NodeRecord, NodeAnswer]:
    """Send the request to the nodes in turn until one answers other than 404."""
    ctx = ctx_of(request)
    last: tuple[NodeRecord, NodeAnswer] | None = None
    for node in await _ordered(ctx, ref):
        try:
            answer = await ctx.nodes.call(node.address, request.method, target(request),
                                          body=body, headers=request.scope["headers"])
        except NodeUnreachable as exc:
            if exc.sent:
                raise
            continue
        if answer.status != 404:
            return node, answer
        last = node, answer
    if last is None:
        raise SandboxUnknown(f"template '{ref}' not found (no node answered)")
    return last


# --- handlers ----------------------------------------------------------------------------

def _named(body: bytes, *fields: str) -> str:
    """The template a JSON body names in the first of `fields` it has ('' if none: the
    node answers the 400)."""
    try:
        sent = json.loads(body)
        return next((str(sent[f]) for f in fields if sent.get(f)), "")
    except (ValueError, AttributeError):
        return ""


async def request_build(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await request.body()
    name = _named(body, "name", "alias")
    node = await _home(ctx, name) if name else None
    if node is None:
        # a build runs a VM as a create does; it is not a sandbox: nothing stays reserved
        placement = await ctx.scheduler.place(PlacementRequest())
        if placement.placement_id:
            await ctx.quietly("releasing a placement",
                              ctx.registry.release(placement.node_id, placement.placement_id))
        node = await ctx.registry.node(placement.node_id)
        if node is None:
            raise NodeUnreachable(f"node {placement.node_id} left the index", sent=False)
    answer = await ctx.nodes.call(node.address, "POST", target(request), body=body,
                                  headers=request.scope["headers"])
    if answer.status in (200, 201, 202):
        got = answer.json()
        refs = [str(got["templateID"]), *(str(a) for a in got.get("aliases") or ())]
        await ctx.quietly("recording a template's node",
                          ctx.registry.set_template_home(refs, node.node_id))
    return answer.response()


async def template_call(request: Request) -> Response:
    """Any call naming one template in its path (get, build start / status, tags list,
    the upload link)."""
    body = await request.body()
    ref = _ref_of(request.url.path)
    node, answer = await _first_that_has(request, ref, body)
    if "/files/" in request.url.path and answer.status == 201:
        return _upload_link(request, node, answer)
    return answer.response()


async def tags_call(request: Request) -> Response:
    """POST /templates/tags ({target: name:tag}), DELETE /templates/tags ({name})."""
    body = await request.body()
    return (await _first_that_has(request, _named(body, "target", "name"), body))[1].response()


def _upload_link(request: Request, node: NodeRecord, answer: NodeAnswer) -> Response:
    """The node's signed upload URL, pointed at the gateway (which relays the PUT)."""
    got = answer.json()
    if got.get("url"):
        parts = urlsplit(str(got["url"]))
        files_hash = parts.path.rsplit("/", 1)[-1]
        got["url"] = (f"{request.base_url}template-files/{node.node_id}/{files_hash}"
                      f"?{parts.query}")
    return answer.response(json.dumps(got).encode())


class Upload:
    """PUT /template-files/{nodeID}/{hash}: relayed, streamed, to that node's
    /template-files/{hash} (no API key: the node checks the URL's signature). An ASGI
    app, not a handler: the relay answers the client itself."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: GatewayContext = scope["app"].state.gateway
        node_id = str(scope["path_params"]["nodeID"])
        node = await ctx.registry.node(node_id)
        if node is None or not node.alive:
            raise SandboxUnknown(f"node {node_id}, which signed this upload URL, is not in "
                                 "the cluster: ask for a new URL")
        path = f"/template-files/{scope['path_params']['hash']}"
        await ctx.nodes.relay(node.address, {**scope, "path": path, "raw_path": path.encode()},
                              receive, send, sandbox_id="")


async def delete(request: Request) -> Response:
    """DELETE /templates/{id} (also Sandbox.delete_snapshot): every live node drops its
    copy, the home last (it withdraws the template from the catalog and releases its
    files); a node that refuses (sandboxes of it use the template) stops the delete."""
    ctx = ctx_of(request)
    ref = str(request.path_params["templateID"])
    order = list(reversed(await _ordered(ctx, ref)))
    found: NodeAnswer | None = None
    last: NodeAnswer | None = None
    for node in order:
        try:
            answer = await ctx.nodes.call(node.address, "DELETE", target(request),
                                          headers=request.scope["headers"])
        except NodeUnreachable:
            continue
        if answer.status not in (204, 404):
            return answer.response()
        last = answer
        if answer.status == 204:
            found = answer
    if found is not None:
        return found.response()
    if last is None:
        raise SandboxUnknown(f"template or snapshot '{ref}' not found (no node answered)")
    return last.response()


# --- listings ----------------------------------------------------------------------------

def _key(item: dict[str, Any]) -> tuple[float, str]:
    return datetime.fromisoformat(str(item["createdAt"])).timestamp(), str(item["templateID"])


def _merge(lists: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per template (the home's has the most builds), newest first."""
    best: dict[str, dict[str, Any]] = {}
    for items in lists:
        for item in items:
            tid = str(item["templateID"])
            have = best.get(tid)
            if have is None or item.get("buildCount", 0) > have.get("buildCount", 0):
                best[tid] = item
    return sorted(best.values(), key=_key, reverse=True)


async def list_v1(request: Request) -> Response:
    nodes = ctx_of(request).nodes
    params = dict(request.query_params)
    validate(tm.ListTemplatesQuery, params, strict=False)

    async def everything(node: NodeRecord) -> list[dict[str, Any]]:
        return (await get_page(nodes, node, "/templates", params, request))[0]

    got, unreachable = await gather({n.node_id: everything(n) for n in await live_nodes(request)})
    return with_unreachable(JSONResponse(_merge(list(got.values()))), unreachable)


async def list_v2(request: Request) -> Response:
    nodes = ctx_of(request).nodes
    params = dict(request.query_params)
    query = validate(tm.ListTemplatesV2Query, params, strict=False)

    async def everything(node: NodeRecord) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        node_params = {"limit": str(PAGE)}
        while True:
            page, token = await get_page(nodes, node, "/v2/templates", node_params, request)
            items += page
            if token is None:
                return items
            node_params["nextToken"] = token

    got, unreachable = await gather({n.node_id: everything(n) for n in await live_nodes(request)})
    merged = _merge(list(got.values()))
    if query.next_token is not None:
        after = (float(query.next_token[0]), str(query.next_token[1]))
        merged = [i for i in merged if _key(i) < after]
    page = merged[:query.limit]
    headers = {}
    if len(merged) > query.limit:
        headers["X-Next-Token"] = encode_cursor(*_key(page[-1]))
    return with_unreachable(JSONResponse(page, headers=headers), unreachable)

