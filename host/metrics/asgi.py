"""The HTTP side of metrics: the `/metrics` route a service mounts (the REST API; the
gateway and scheduler the same way), and `ProxyMetrics`, the ASGI middleware that counts
the sandbox proxy's requests and bytes from outside the proxy app (`ExchangeMetrics`: the
same counting into other counters, e.g. the cluster gateway's).

`/metrics` needs no API key (Prometheus scrapes without one, by convention): it shows
counts and durations, never ids, tokens or metadata. Keep the API listener off public
networks, or use `--no-metrics`, where that is not acceptable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import Counter
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .instruments import Metrics, ServiceMetrics

METRICS_PATH = "/metrics"


def metrics_endpoint(metrics: ServiceMetrics) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return Response(await metrics.render(), headers={"content-type": CONTENT_TYPE_LATEST})

    return endpoint


def metrics_route(metrics: ServiceMetrics, path: str = METRICS_PATH) -> Route:
    """`GET /metrics`: the registry in Prometheus text format (not part of the E2B API
    nor its OpenAPI document)."""
    return Route(path, metrics_endpoint(metrics), methods=["GET"])


def status_class(status: int | None) -> str:
    return "none" if status is None else f"{status // 100}xx"


def _message_bytes(message: Message) -> int:
    """Bytes of a WebSocket message (text as UTF-8, as on the wire)."""
    data = message.get("bytes")
    if data is not None:
        return len(data)
    text = message.get("text")
    return len(text.encode()) if text is not None else 0


class ExchangeMetrics:
    """Counts each HTTP request and WebSocket session the wrapped app serves in
    `requests{kind, status}` (when it ends; `kind`: the scope type, or `kinds[type]`) and,
    with `transferred`, the body / message bytes both ways as they pass
    (`transferred{direction}`: in from clients, out to clients). Requests for a host in
    `skip_hosts` and lifespan events pass untouched."""

    def __init__(self, app: ASGIApp, requests: Counter, transferred: Counter | None = None,
                 *, kinds: Mapping[str, str] | None = None,
                 skip_hosts: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.requests = requests
        self.kinds = dict(kinds or {})
        self.skip_hosts = skip_hosts
        self._in = transferred.labels("in") if transferred is not None else None
        self._out = transferred.labels("out") if transferred is not None else None

    def _skipped(self, scope: Scope) -> bool:
        if scope["type"] not in ("http", "websocket"):
            return True
        if not self.skip_hosts:
            return False
        for name, value in scope.get("headers", ()):
            if name == b"host":
                return value.decode("latin-1").rsplit(":", 1)[0].lower() in self.skip_hosts
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._skipped(scope):
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def counted_receive() -> Message:
            message = await receive()
            kind = message["type"]
            if kind == "http.request":
                n = len(message.get("body", b""))
            elif kind == "websocket.receive":
                n = _message_bytes(message)
            else:
                n = 0
            if n and self._in is not None:
                self._in.inc(n)
            return message

        async def counted_send(message: Message) -> None:
            nonlocal status
            kind = message["type"]
            n = 0
            if kind in ("http.response.start", "websocket.http.response.start"):
                status = int(message["status"])
            elif kind in ("http.response.body", "websocket.http.response.body"):
                n = len(message.get("body", b""))
            elif kind == "websocket.accept":
                status = 101
            elif kind == "websocket.send":
                n = _message_bytes(message)
            elif kind == "websocket.close" and status is None:
                status = 403  # closed before the handshake: the server answers 403
            await send(message)
            if n and self._out is not None:
                self._out.inc(n)

        try:
            await self.app(scope, counted_receive, counted_send)
        except Exception:
            if status is None:
                status = 500  # what the server answers for an app that raised
            raise
        finally:
            label = self.kinds.get(scope["type"], scope["type"])
            self.requests.labels(label, status_class(status)).inc()


class ProxyMetrics(ExchangeMetrics):
    """The sandbox proxy's requests and bytes (`aenv_proxy_requests_total{kind, status}`,
    `aenv_proxy_bytes_total{direction}`), counted from outside the proxy app. Requests for
    a host in `skip_hosts` (the API served on the proxy's TLS listener) pass untouched."""

    def __init__(self, app: ASGIApp, metrics: Metrics, *,
                 skip_hosts: frozenset[str] = frozenset()) -> None:
        super().__init__(app, metrics.proxy_requests, metrics.proxy_bytes,
                         skip_hosts=skip_hosts)
        self.metrics = metrics
