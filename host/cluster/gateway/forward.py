"""Requests into nodes, over the sandbox proxy's pooled HTTP/1.1 client
(host/proxy/upstream.py: h11, idle connections per node, a request is sent a second time
only when that cannot run it twice).

    NodeClient.call   one REST call into a node's API, its answer read whole (API answers
                      are small; the gateway reads some of them: created ids, pages)
    NodeClient.relay  one sandbox-traffic exchange with a node's proxy, streamed both ways
                      (envd's Connect streams, file transfers, user ports), ended when the
                      client goes away

A failure before the request could reach the node is `NodeUnreachable(sent=False)`: the
caller may send it elsewhere. After that it is `sent=True`, and only idempotent requests
may be repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from host.proxy import responses
from host.proxy.upstream import Pool, UpstreamError, UpstreamUnreachable

from ..errors import NodeUnreachable

if TYPE_CHECKING:
    from .metrics import GatewayMetrics

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]

# Hop-by-hop headers (RFC 9110 §7.6.1) and those the server side already handled.
HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                 b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
                 b"expect"})
_RESET = HOP | {b"host", b"x-api-key", b"content-length"}
# set by the gateway's own server on every answer; the node's copies would be duplicates
_OWN = frozenset({b"content-length", b"date", b"server"})


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of a node's http:// address."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise NodeUnreachable(f"node address {url!r} is not an http:// URL (the gateway "
                              "reaches nodes over plain HTTP)", sent=False)
    return parts.hostname, parts.port or 80


@dataclass(frozen=True)
class NodeAnswer:
    status: int
    headers: Headers
    body: bytes

    def header(self, name: str) -> str | None:
        key = name.lower().encode()
        for k, v in self.headers:
            if k.lower() == key:
                return v.decode("latin-1")
        return None

    def json(self) -> Any:
        return json.loads(self.body)

    def response(self, body: bytes | None = None) -> Response:
        """This answer for the client (`body` replaces the node's)."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in self.headers
                   if k.lower() not in HOP and k.lower() not in _OWN}
        return Response(self.body if body is None else body, status_code=self.status,
                        headers=headers)


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


class NodeClient:
    """Calls into nodes with the cluster's node key. `aclose()` closes the pool.
    `metrics`: API calls that got an answer are timed there by operation group, and a
    node the traffic relay could not reach is counted as an error."""

    def __init__(self, node_key: str, *, pool: Pool | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.node_key = node_key
        self.pool = pool or Pool(connect_timeout_s=5.0)
        self.metrics = metrics

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def call(self, address: str, method: str, target: str, *, body: bytes = b"",
                   headers: Sequence[tuple[bytes, bytes]] = (),
                   timeout_s: float | None = None, operation: str = "other") -> NodeAnswer:
        """One API call into the node at `address`; `headers`: the client's (hop-by-hop,
        Host, X-API-Key and Content-Length are replaced); `operation`: its group in the
        metrics (metrics.OPERATIONS)."""
        host, port = host_port(address)
        t0 = time.perf_counter()
        out = [(k, v) for k, v in headers if k.lower() not in _RESET]
        out += [(b"host", f"{host}:{port}".encode()), (b"x-api-key", self.node_key.encode())]
        if body or method in ("POST", "PUT", "PATCH"):
            out.append((b"content-length", str(len(body)).encode()))
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self.pool.request(host, port, method.encode(), target.encode(),
                                               out, _once(body) if body else None)
                chunks = []
                stream = resp.aiter_body()
                try:
                    async for chunk in stream:
                        chunks.append(chunk)
                finally:
                    await stream.aclose()
                    resp.abandon()
        except UpstreamUnreachable as exc:
            raise NodeUnreachable(f"node at {address} is unreachable: {exc}", sent=False) from exc
        except UpstreamError as exc:
            raise NodeUnreachable(f"node at {address} broke the connection: {exc}",
                                  sent=True) from exc
        except TimeoutError as exc:
            raise NodeUnreachable(f"node at {address} did not answer within {timeout_s} s",
                                  sent=True) from exc
        if self.metrics is not None:
            self.metrics.node_call(operation, time.perf_counter() - t0)
        return NodeAnswer(resp.status, resp.headers, b"".join(chunks))

    # --- sandbox traffic ---------------------------------------------------------------

    async def relay(self, address: str, scope: Scope, receive: Receive, send: Send, *,
                    sandbox_id: str) -> None:
        """Forward one HTTP exchange to the node proxy at `address` unchanged (its Host
        and E2b-Sandbox-* headers tell the node's proxy which sandbox port it is for)."""
        host, port = host_port(address)
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP]
        names = {k for k, _ in headers}
        if b"host" not in names:
            headers.append((b"host", f"{host}:{port}".encode()))
        client = scope.get("client")
        if client:
            headers.append((b"x-forwarded-for", client[0].encode()))
        body_done = asyncio.Event()
        content = None
        if b"content-length" in names:
            content = _client_body(receive, body_done)
        elif any(k == b"transfer-encoding" for k, _ in scope["headers"]):
            headers.append((b"transfer-encoding", b"chunked"))
            content = _client_body(receive, body_done)
        else:
            body_done.set()
        query = scope.get("query_string", b"")
        target = (scope.get("raw_path") or scope["path"].encode()) + (
            b"?" + query if query else b"")
        this = asyncio.current_task()
        assert this is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await body_done.wait()  # receive() belongs to the body reader until then
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            this.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self._pump(host, port, scope["method"].encode(), target, headers, content,
                             send, sandbox_id)
        except asyncio.CancelledError:
            if not gone or this.uncancel() != 0:
                raise
        except _ClientGone:
            pass
        finally:
            watcher.cancel()

    async def _pump(self, host: str, port: int, method: bytes, target: bytes, headers: Headers,
                    content: AsyncIterator[bytes] | None, send: Send, sandbox_id: str) -> None:
        try:
            upstream = await self.pool.request(host, port, method, target, headers, content)
        except UpstreamError as exc:
            if self.metrics is not None:
                self.metrics.error(502, NodeUnreachable.error_code)
            await responses.send_json(send, 502, f"The sandbox's node is unreachable: {exc}",
                                      sandbox_id=sandbox_id)
            return
        body = upstream.aiter_body()
        try:
            await send({"type": "http.response.start", "status": upstream.status,
                        "headers": [(k, v) for k, v in upstream.headers
                                    if k.lower() not in HOP
                                    and k.lower() not in (b"date", b"server")]})
            try:
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
            except UpstreamError as exc:
                # started: all we can do is cut the client off too
                log.info("node proxy %s:%s broke mid-response: %s", host, port, exc)
                raise _ClientGone from exc
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with contextlib.suppress(Exception):
                await body.aclose()
            upstream.abandon()


class _ClientGone(Exception):
    """The client went away (or must be cut off) mid-exchange."""


async def _client_body(receive: Receive, done: asyncio.Event) -> AsyncIterator[bytes]:
    while True:
        msg: Message = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone
        chunk = msg.get("body", b"")
        if chunk:
            yield chunk
        if not msg.get("more_body", False):
            break
    done.set()
