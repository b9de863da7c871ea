"""Listings over every live node: sandboxes (v2 paginated, v1 whole) and snapshots.

GET /v2/sandboxes keeps the node's order and token semantics (host/api/sandboxes.py):
items by (startedAt, sandboxID), descending unless `order=asc`, and `nextToken` is the
position of the last item returned, so one token is valid on every node. The gateway
compares times in whole microseconds (what `startedAt` carries on the wire); nodes get a
position a few microseconds wider than the token's, and the gateway drops what it had
already returned. Each node is asked for up to `limit` items past the position, the
answers are merged, the first `limit` returned, and `X-Next-Token` is set while any node
has more.

GET /snapshots has no order across nodes on the wire (SnapshotInfo carries no time), so
its pages go node after node (by id), and its token is the node and that node's own token.

A node that does not answer is left out, named in `X-Aenv-Unreachable-Nodes`; dead nodes'
sandboxes are not listed (the SDKs accept only `running` and `paused` states: they are
reported by GET /sandboxes/{id} and GET /nodes/{id}).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from host.api import models as m
from host.api.errors import ApiError
from host.api.types import encode_cursor
from host.api.validation import validate

from ..errors import NodeUnreachable
from ..registry import NodeRecord
from .forward import NodeClient
from .shared import ctx_of

LIST_TIMEOUT_S = 30.0
_WIDEN_US = 2            # float seconds resolve ~0.24 us today: a safe margin
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)

Key = tuple[int, str]


def key_of(item: dict[str, Any]) -> Key:
    """(startedAt in whole microseconds, sandboxID)."""
    started = datetime.fromisoformat(str(item["startedAt"]))
    return (started - _EPOCH) // _US, str(item["sandboxID"])


@dataclass
class _Feed:
    node_id: str
    items: list[dict[str, Any]]
    more: bool          # the node has items past these


class _Unreachable(Exception):
    pass


async def get_page(nodes: NodeClient, node: NodeRecord, path: str, params: dict[str, str],
               request: Request) -> tuple[list[dict[str, Any]], str | None]:
    """One page from a node: (items, its X-Next-Token). A node's 4xx is the client's."""
    target = path + ("?" + urlencode(params) if params else "")
    try:
        answer = await nodes.call(node.address, "GET", target, headers=request.scope["headers"],
                                  timeout_s=LIST_TIMEOUT_S, operation="list")
    except NodeUnreachable as exc:
        raise _Unreachable(node.node_id) from exc
    if answer.status != 200:
        try:
            message = str(answer.json().get("message"))
        except (ValueError, AttributeError):
            message = answer.body[:300].decode("utf-8", "replace")
        if 400 <= answer.status < 500:
            raise ApiError(answer.status, message)
        raise _Unreachable(node.node_id)
    return list(answer.json()), answer.header("x-next-token") or None


async def live_nodes(request: Request) -> list[NodeRecord]:
    return await ctx_of(request).registry.live_nodes()


def with_unreachable(response: Response, unreachable: Sequence[str]) -> Response:
    if unreachable:
        response.headers["X-Aenv-Unreachable-Nodes"] = ",".join(sorted(unreachable))
    return response


async def gather(calls: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Run one coroutine per node; (results by node, nodes that did not answer)."""
    ids = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    out, unreachable = {}, []
    for nid, res in zip(ids, results, strict=True):
        if isinstance(res, _Unreachable):
            unreachable.append(nid)
        elif isinstance(res, BaseException):
            raise res
        else:
            out[nid] = res
    return out, unreachable


# --- GET /v2/sandboxes ---------------------------------------------------------------------

async def list_v2(request: Request) -> Response:
    params = dict(request.query_params)
    query = validate(m.ListSandboxesQuery, params, strict=False)   # 400 as a node says it
    desc = query.order == "desc"
    after: Key | None = None
    if query.next_token is not None:
        after = (round(query.next_token[0] * 1_000_000), query.next_token[1])
    params.pop("nextToken", None)
    params["limit"] = str(query.limit)
    nodes = ctx_of(request).nodes

    def past(k: Key) -> bool:
        return after is None or (k < after if desc else k > after)

    async def feed(node: NodeRecord) -> _Feed:
        node_params = dict(params)
        if after is not None:   # a little wider than `after`; the excess is dropped below
            edge = after[0] + _WIDEN_US if desc else after[0] - _WIDEN_US
            node_params["nextToken"] = encode_cursor(edge / 1_000_000, "")
        items: list[dict[str, Any]] = []
        while True:
            page, token = await get_page(nodes, node, "/v2/sandboxes", node_params, request)
            items += [i for i in page if past(key_of(i))]
            if token is None or len(items) >= query.limit:
                return _Feed(node.node_id, items, token is not None)
            node_params["nextToken"] = token

    feeds, unreachable = await gather({n.node_id: feed(n) for n in await live_nodes(request)})
    merged = sorted((i for f in feeds.values() for i in f.items), key=key_of, reverse=desc)
    page = merged[:query.limit]
    more = len(merged) > query.limit or any(f.more for f in feeds.values())
    headers = {}
    if more and page:
        last_us, last_id = key_of(page[-1])
        headers["X-Next-Token"] = encode_cursor(last_us / 1_000_000, last_id)
    return with_unreachable(JSONResponse(page, headers=headers), unreachable)


# --- GET /sandboxes (legacy: running ones, no pagination) ------------------------------------

async def list_v1(request: Request) -> Response:
    params = dict(request.query_params)
    validate(m.ListSandboxesV1Query, params, strict=False)
    nodes = ctx_of(request).nodes

    async def everything(node: NodeRecord) -> list[dict[str, Any]]:
        return (await get_page(nodes, node, "/sandboxes", params, request))[0]

    pages, unreachable = await gather({n.node_id: everything(n) for n in await live_nodes(request)})
    items = sorted((i for p in pages.values() for i in p), key=key_of, reverse=True)
    return with_unreachable(JSONResponse(items), unreachable)


# --- GET /snapshots ------------------------------------------------------------------------

def encode_snapshot_token(node_id: str, token: str | None) -> str:
    raw = json.dumps({"node": node_id, "token": token}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_snapshot_token(token: str) -> tuple[str, str | None]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        node, inner = data["node"], data["token"]
        if not isinstance(node, str) or not (inner is None or isinstance(inner, str)):
            raise TypeError("bad token shape")
    except (binascii.Error, ValueError, TypeError, KeyError):
        raise ApiError(400, "'nextToken' must be the X-Next-Token of the previous page") from None
    return node, inner


async def list_snapshots(request: Request) -> Response:
    ctx = ctx_of(request)
    params = dict(request.query_params)
    raw_token = params.pop("nextToken", None) or None
    query = validate(m.ListSnapshotsQuery, params, strict=False)
    if query.sandbox_id:   # one sandbox's snapshots are on its node
        loc = await ctx.resolver.locate(query.sandbox_id)
        if raw_token:
            params["nextToken"] = raw_token
        items, token = await get_page(ctx.nodes, loc.node, "/snapshots", params, request)
        headers = {"X-Next-Token": token} if token else {}
        return JSONResponse(items, headers=headers)
    start, inner = decode_snapshot_token(raw_token) if raw_token else ("", None)
    nodes = [n for n in await live_nodes(request) if n.node_id >= start]
    page: list[dict[str, Any]] = []
    unreachable: list[str] = []
    next_token = None
    for i, node in enumerate(nodes):
        node_params = {**params, "limit": str(query.limit - len(page))}
        if inner is not None and node.node_id == start:
            node_params["nextToken"] = inner
        try:
            items, token = await get_page(ctx.nodes, node, "/snapshots", node_params, request)
        except _Unreachable:
            unreachable.append(node.node_id)
            continue
        page += items
        if token is not None:
            next_token = encode_snapshot_token(node.node_id, token)
            break
        if len(page) >= query.limit:
            if i + 1 < len(nodes):
                next_token = encode_snapshot_token(nodes[i + 1].node_id, None)
            break
    headers = {"X-Next-Token": next_token} if next_token else {}
    return with_unreachable(JSONResponse(page, headers=headers), unreachable)
