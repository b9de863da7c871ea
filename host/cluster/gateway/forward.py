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

A node advertised at an https:// address is reached over TLS and its certificate verified
for that host name, against --node-tls-ca where given (`node_tls`), else the system's CAs.

Sandbox traffic goes to the node's proxy with the client's headers less the client's API
key and forwarding headers (`traffic_headers`); the traffic token and envd's token go on,
since the node's proxy checks the one and passes the other to envd only
(host/httpheaders.py says who drops what).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from host.httpheaders import (
    API_KEY,
    FORWARDING,
    HOP_BY_HOP,
    Headers,
    forwarding,
    without,
)
from host.proxy import responses
from host.proxy.upstream import Pool, UpstreamError, UpstreamUnreachable

from ..errors import NodeUnreachable

if TYPE_CHECKING:
    from .metrics import GatewayMetrics

log = logging.getLogger(__name__)

# an API call's headers the gateway sets itself (X-API-Key: the node key)
_RESET = HOP_BY_HOP | {b"host", API_KEY, b"content-length"}
# sandbox traffic: the client's key is the gateway's business only; forwarding headers
# are set again (to this hop's peer)
_NOT_TRAFFIC = HOP_BY_HOP | FORWARDING | {API_KEY}
# set by the gateway's own server on every answer; the node's copies would be duplicates
_OWN = frozenset({b"content-length", b"date", b"server"})


def traffic_headers(scope: Scope, *, drop: frozenset[bytes] = frozenset()) -> Headers:
    """The client's headers for the node's proxy (also less `drop`), X-Forwarded-For/-Proto
    the client's address and scheme here: the node's proxy checks the traffic token and
    drops our credentials before the sandbox (host/proxy/forwarding.py)."""
    return forwarding(without(scope["headers"], _NOT_TRAFFIC | drop), scope)


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of a node's http:// or https:// address."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NodeUnreachable(f"node address {url!r} is not an http(s):// URL", sent=False)
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def is_tls(url: str) -> bool:
    return url.startswith("https://")


def node_tls(ca: Path | None = None) -> ssl.SSLContext:
    """The context https:// nodes are verified with: `ca` only (a cluster's own CA), else
    the system's CAs. HTTP/1.1 only, as the pool speaks. ValueError: `ca` is unreadable
    or holds no PEM certificate."""
    try:
        ctx = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    except OSError as exc:   # ssl.SSLError too
        raise ValueError(f"node TLS CA {ca}: {exc}") from None
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


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
                   if k.lower() not in HOP_BY_HOP and k.lower() not in _OWN}
        return Response(self.body if body is None else body, status_code=self.status,
                        headers=headers)


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


class NodeClient:
    """Calls into nodes with the cluster's node key. `aclose()` closes the pool.
    `metrics`: API calls that got an answer are timed there by operation group, and a
    node the traffic relay could not reach is counted as an error."""

    def __init__(self, node_key: str, *, pool: Pool | None = None,
                 tls: ssl.SSLContext | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.node_key = node_key
        self.pool = pool or Pool(connect_timeout_s=5.0)
        # https:// nodes: a pool of their own (its connections are all TLS)
        self.tls = tls or node_tls()
        self.tls_pool = Pool(connect_timeout_s=5.0, tls=self.tls)
        self.metrics = metrics

    async def aclose(self) -> None:
        try:
            await self.pool.aclose()
        finally:
            await self.tls_pool.aclose()

    def _pool(self, address: str) -> Pool:
        return self.tls_pool if is_tls(address) else self.pool

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
                resp = await self._pool(address).request(
                    host, port, method.encode(), target.encode(), out,
                    _once(body) if body else None)
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
        headers = traffic_headers(scope)
        names = {k for k, _ in headers}
        if b"host" not in names:
            headers.append((b"host", f"{host}:{port}".encode()))
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
            await self._pump(self._pool(address), host, port, scope["method"].encode(),
                             target, headers, content, send, sandbox_id)
        except asyncio.CancelledError:
            if not gone or this.uncancel() != 0:
                raise
        except _ClientGone:
            pass
        finally:
            watcher.cancel()

    async def _pump(self, pool: Pool, host: str, port: int, method: bytes, target: bytes,
                    headers: Headers, content: AsyncIterator[bytes] | None, send: Send,
                    sandbox_id: str) -> None:
        try:
            upstream = await pool.request(host, port, method, target, headers, content)
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
                                    if k.lower() not in HOP_BY_HOP
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
