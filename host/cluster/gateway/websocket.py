"""WebSocket sandbox traffic: relayed message by message to the node's proxy (which relays
it into the sandbox), after both handshakes. The node's proxy sees the client's Host and
headers, so it resolves the same sandbox port the gateway did.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import TYPE_CHECKING, Any

import websockets
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import connect as ws_connect

from host.httpheaders import WS_HANDSHAKE
from host.proxy.wspump import pump_down, pump_up, refuse

from ..errors import NodeUnreachable
from .forward import host_port, is_tls, traffic_headers

if TYPE_CHECKING:
    from .metrics import GatewayMetrics


async def relay_websocket(address: str, scope: Scope, receive: Receive, send: Send, *,
                          sandbox_id: str, open_timeout_s: float = 10.0,
                          tls: ssl.SSLContext | None = None,
                          metrics: GatewayMetrics | None = None) -> None:
    """Relay one WebSocket session to the node proxy at `address` (`metrics`: a node that
    cannot be reached is counted as an error; the node's own refusal is its answer).
    An https:// address is reached over TLS verified with `tls` (forward.node_tls)."""
    host, port = host_port(address)
    raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string", b"").decode("latin-1")
    client_host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"),
                       f"{host}:{port}")
    headers = [(k.decode("latin-1"), v.decode("latin-1"))
               for k, v in traffic_headers(scope, drop=WS_HANDSHAKE)]
    # the URI carries the client's Host (the node's proxy routes by it); the TCP connection
    # goes to the node's proxy, whose certificate is checked for the node's host name
    secure = is_tls(address)
    uri = f"{'wss' if secure else 'ws'}://{client_host}{raw_path}" + (f"?{query}" if query else "")
    tls_args: dict[str, Any] = {"ssl": tls or True, "server_hostname": host} if secure else {}
    try:
        upstream = await ws_connect(
            uri, host=host, port=port, additional_headers=headers, **tls_args,
            subprotocols=scope.get("subprotocols") or None, open_timeout=open_timeout_s,
            max_size=None, compression=None, user_agent_header=None, ping_interval=None)
    except websockets.InvalidStatus as exc:
        await refuse(scope, receive, send, exc.response.status_code,
                     f"the node refused the WebSocket: {exc}", sandbox_id)
        return
    except (OSError, TimeoutError, websockets.InvalidHandshake, websockets.InvalidURI) as exc:
        if metrics is not None:
            metrics.error(502, NodeUnreachable.error_code)
        await refuse(scope, receive, send, 502, f"The sandbox's node is unreachable: {exc}",
                     sandbox_id)
        return
    async with upstream:
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        tasks: set[asyncio.Task[Any]] = {asyncio.create_task(pump_down(upstream, send)),
                                         asyncio.create_task(pump_up(receive, upstream))}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
