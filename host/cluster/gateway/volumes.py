"""Volumes through the gateway: any node serves any volume.

The nodes of a cluster share a posix_fs repository, and volumes (records, names, bytes,
the tokens' secret) live in it (host/volumes/records.py), so every node answers every
volume call the same way, and a sandbox on any node mounts any volume:

    /volumes, /volumes/{id}          the first live node that can be reached (API key
                                     replaced by the node key, as for every API call)
    /volumecontent/{id}/...          relayed, streamed both ways, to a live node: the
                                     volume's Bearer token authorises it there

A request that may have reached a node is not sent to another (`NodeUnreachable.sent`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..errors import NodeUnreachable
from .sandboxes import target
from .shared import GatewayContext, ctx_of


def _none_live() -> NodeUnreachable:
    return NodeUnreachable("no live node could be reached for the volume call", sent=False)


async def volume_call(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await request.body()
    for node in await ctx.registry.live_nodes():
        try:
            answer = await ctx.nodes.call(node.address, request.method, target(request),
                                          body=body, headers=request.scope["headers"])
        except NodeUnreachable as exc:
            if exc.sent:
                raise
            continue
        return answer.response()
    raise _none_live()


class Content:
    """/volumecontent/{volumeID}/...: an ASGI app (the relay answers the client itself)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: GatewayContext = scope["app"].state.gateway
        live = await ctx.registry.live_nodes()
        if not live:
            raise _none_live()
        await ctx.nodes.relay(live[0].address, scope, receive, send, sandbox_id="")
