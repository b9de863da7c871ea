"""The gateway: the one endpoint of a cluster (ASGI, served on :8080 by __main__.py).

Each request is either sandbox traffic or an API call:

    Host `<port>-<id>.<domain>`        traffic, by host (E2B_DOMAIN mode)
    an `E2b-Sandbox-Id` header         traffic, by headers (E2B_SANDBOX_URL mode); the
                                       node's proxy gets Host `localhost` (so that it
                                       routes by the headers too) unless the client's Host
                                       already is a loopback name or an IP address
    anything else (`api.<domain>`...)  the REST API, behind the API key (X-API-Key)

Traffic goes to the proxy of the node holding the sandbox, streamed (HTTP) or relayed
(WebSocket); the node's proxy does the rest (envd's blocked routes, traffic tokens,
auto-resume). API calls: sandboxes.py (create, per-sandbox calls), listing.py,
nodes.py.

API keys: the gateway checks the client's X-API-Key against its own key file (constant
time, host/api/auth.py) and calls nodes and the scheduler with the cluster's node key, a
secret of its own that no client holds (the gateway refuses to start when it is one of
the API keys, and does not accept it from clients), so client keys can be added or
revoked at the gateway alone. `GET /health` and `GET /metrics` (Prometheus text format,
metrics.py) need no key (auth.py's open paths). Nodes at https:// addresses are reached
over TLS, verified with --node-tls-ca (forward.py).

Metrics: the API and the traffic are each wrapped in host/metrics' `ExchangeMetrics`
(requests by kind and status class, traffic bytes); /health and /metrics themselves are
not counted. The errors the gateway answers itself are counted by the exception
handlers, the key check, the traffic's refusals and the relays (forward.py, websocket.py).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from host.api.auth import ApiKeyMiddleware, ApiKeys, NodeKeys, check_separate
from host.api.errors import ApiError, error_response, response_for
from host.httpheaders import header
from host.ids import ROUTABLE_ID_BODY
from host.metrics import METRICS_PATH, ExchangeMetrics, metrics_route
from host.proxy import responses
from host.proxy.routing import (
    ENVD_PORT,
    BadTarget,
    Target,
    host_name,
    parse_target,
    routes_by_headers,
)
from host.proxy.signed import SignedFileRequest
from host.proxy.wspump import refuse

from ..config import GatewayConfig
from ..errors import ClusterError, SandboxLost, SandboxStranded, SandboxUnknown, error_reply
from ..registry import Registry
from ..store import DEFAULT_PREFIX, ClusterStore
from . import listing, nodes, sandboxes, templates, volumes
from .forward import NodeClient, node_tls
from .metrics import GatewayMetrics, error_code
from .resolve import Resolver
from .scheduling import SchedulerClient
from .shared import GatewayContext
from .websocket import relay_websocket

_PORT_HOST = re.compile(rf"^[0-9]+-{ROUTABLE_ID_BODY}\.")   # `<port>-<id>.`: traffic
_ANY = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
_PROBES = frozenset({"/health", METRICS_PATH})   # API paths not counted as requests
_FOUND = "aenv.gateway.found"   # scope key: classify()'s answer for the traffic app


def classify(scope: Scope, domain: str | None) -> tuple[Target, bool] | None:
    """(target, routed by headers) for sandbox traffic; None for an API call. Raises
    BadTarget for traffic that names no valid sandbox port (-> 400)."""
    host = host_name(header(scope, b"host") or "")
    if domain and host == f"api.{domain}":
        return None
    if _PORT_HOST.match(host):
        return parse_target(host, None, None, None), False
    sandbox_id = header(scope, b"e2b-sandbox-id")
    if sandbox_id is None:
        return None
    return parse_target("localhost", sandbox_id, header(scope, b"e2b-sandbox-port"), None), True


async def health(request: Request) -> Response:
    await request.app.state.gateway.store.ping()
    return JSONResponse({"status": "ok"})


async def unsupported(request: Request) -> Response:
    raise ApiError(404, f"{request.method} {request.url.path} is not an E2B template route")


def _metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


async def _cluster_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ClusterError)
    _metrics(request).error(exc.status, exc.error_code)
    return error_reply(exc, method=request.method)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    _metrics(request).error(exc.status, exc.error_code)
    return response_for(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    _metrics(request).error(exc.status_code)
    return error_response(exc.status_code, str(exc.detail))


class _KeyCheck:
    """host/api/auth.py's key check, its refusals (401) counted as errors."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics: GatewayMetrics) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        passed = False

        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            nonlocal passed
            passed = True
            await self.app(scope, receive, send)

        await ApiKeyMiddleware(inner, self.keys)(scope, receive, send)
        if not passed:
            self.metrics.error(401)


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/nodes", nodes.list_nodes, methods=["GET"]),
    Route("/nodes/{nodeID}", nodes.get_node, methods=["GET"]),
    Route("/v2/sandboxes", sandboxes.create, methods=["POST"]),
    Route("/v2/sandboxes", listing.list_v2, methods=["GET"]),
    Route("/sandboxes", sandboxes.create, methods=["POST"]),
    Route("/sandboxes", listing.list_v1, methods=["GET"]),
    Route("/sandboxes/{sandboxID}", sandboxes.sandbox_call, methods=_ANY),
    Route("/sandboxes/{sandboxID}/{rest:path}", sandboxes.sandbox_call, methods=_ANY),
    Route("/v2/sandboxes/{sandboxID}/{rest:path}", sandboxes.sandbox_call, methods=_ANY),
    Route("/snapshots", listing.list_snapshots, methods=["GET"]),
    # volumes (volumes.py): every node serves every volume (the shared repository)
    Route("/volumes", volumes.volume_call, methods=["GET", "POST"]),
    Route("/volumes/{volumeID}", volumes.volume_call, methods=["GET", "DELETE"]),
    Route("/volumecontent/{volumeID}/{rest:path}", volumes.Content(), methods=_ANY),
    # templates (templates.py); `path`: ids like aenv/app:v1 arrive decoded
    Route("/v3/templates", templates.request_build, methods=["POST"]),
    Route("/templates", templates.list_v1, methods=["GET"]),
    Route("/v2/templates", templates.list_v2, methods=["GET"]),
    Route("/templates/tags", templates.tags_call, methods=["POST", "DELETE"]),
    Route("/template-files/{nodeID}/{hash}", templates.Upload(), methods=["PUT"]),
    Route("/templates/{templateID:path}", templates.delete, methods=["DELETE"]),
    Route("/templates/{templateID:path}", templates.template_call, methods=["GET"]),
    Route("/v2/templates/{templateID:path}", templates.template_call, methods=["POST"]),
    *[Route(f"{prefix}{{rest:path}}", unsupported, methods=_ANY)
      for prefix in ("/templates", "/v2/templates", "/v3/templates", "/template-files")],
]


class Gateway:
    """The gateway's ASGI app; serve with lifespan="on" (Redis, the node pool and the
    scheduler client live in it)."""

    def __init__(self, cfg: GatewayConfig, keys: ApiKeys, node_keys: NodeKeys, *,
                 prefix: str = DEFAULT_PREFIX, metrics: GatewayMetrics | None = None) -> None:
        check_separate(keys, node_keys)
        self.cfg = cfg
        self.domain = cfg.domain.lower() if cfg.domain else None
        self.metrics = metrics = metrics if metrics is not None else GatewayMetrics()
        key = node_keys.first
        tls = node_tls(cfg.node_tls_ca)   # read now: a bad CA file fails the start

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            store = ClusterStore.from_url(cfg.redis, prefix=prefix)
            registry = Registry(store)
            client = NodeClient(key, tls=tls, metrics=metrics)
            scheduler = SchedulerClient(cfg.scheduler, key)
            app.state.gateway = GatewayContext(store, registry, client,
                                               Resolver(registry, client), scheduler,
                                               cfg.domain, metrics)
            try:
                yield
            finally:
                await scheduler.aclose()
                await client.aclose()
                await store.aclose()

        self.api = Starlette(
            routes=[metrics_route(metrics), *ROUTES], lifespan=lifespan,
            middleware=[Middleware(_KeyCheck, keys=keys, metrics=metrics)],
            exception_handlers={ClusterError: _cluster_error, ApiError: _api_error,
                                HTTPException: _http_error})
        self.api.state.metrics = metrics
        # the index by state at each scrape, once the lifespan opened Redis
        metrics.track_cluster(lambda: self.api.state.gateway.registry)
        self._counted_api = ExchangeMetrics(self.api, metrics.requests,
                                            kinds={"http": "api", "websocket": "api"})
        self._counted_traffic = ExchangeMetrics(self._serve_traffic, metrics.requests,
                                                metrics.sandbox_bytes,
                                                kinds={"http": "sandbox-http"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.api(scope, receive, send)  # the lifespan
            return
        try:
            found: tuple[Target, bool] | BadTarget | SignedFileRequest | None = classify(
                scope, self.domain)
        except BadTarget as exc:
            found = exc
        if found is None:   # a signed /files URL that names no sandbox is traffic too
            found = SignedFileRequest.of(scope)
        if found is not None:
            scope[_FOUND] = found
            await self._counted_traffic(scope, receive, send)
        elif scope["path"] in _PROBES:
            await self.api(scope, receive, send)
        else:
            await self._counted_api(scope, receive, send)

    async def _serve_traffic(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = scope[_FOUND]
        if isinstance(found, BadTarget):
            await self._deny(scope, receive, send, 400, str(found))
            return
        if isinstance(found, SignedFileRequest):
            await self._signed(scope, receive, send, found)
            return
        target, by_headers = found
        await self._traffic(scope, receive, send, target, by_headers)

    async def _signed(self, scope: Scope, receive: Receive, send: Send,
                      signed: SignedFileRequest) -> None:
        """A signed /files URL without E2b-Sandbox-* headers: to the envd of the sandbox
        whose token made the signature, by headers (the node's proxy routes by them)."""
        ctx: GatewayContext = self.api.state.gateway
        try:
            sid = await ctx.resolver.signer(signed)
        except ClusterError as exc:
            await self._deny(scope, receive, send, exc.status, exc.message,
                             code=error_code(exc.status, exc.error_code))
            return
        if sid is None:   # as a node's proxy answers it (host/proxy/signed.py)
            await self._deny(scope, receive, send, 400, "missing header E2b-Sandbox-Id (and "
                             "no sandbox's token made this URL's signature)")
            return
        scope = {**scope, "headers": [*scope["headers"], (b"e2b-sandbox-id", sid.encode()),
                                      (b"e2b-sandbox-port", str(ENVD_PORT).encode())]}
        await self._traffic(scope, receive, send, Target(sid, ENVD_PORT), True)

    async def _deny(self, scope: Scope, receive: Receive, send: Send, status: int,
                    message: str, sandbox_id: str | None = None, *,
                    code: str | None = None) -> None:
        """Refuse sandbox traffic (counted as an error: `code`, else the status's name)."""
        self.metrics.error(status, code)
        if scope["type"] == "websocket":
            await refuse(scope, receive, send, status, message, sandbox_id)
        else:
            await responses.send_json(send, status, message, sandbox_id=sandbox_id)

    async def _traffic(self, scope: Scope, receive: Receive, send: Send, target: Target,
                       by_headers: bool) -> None:
        ctx: GatewayContext = self.api.state.gateway
        sid = target.sandbox_id
        try:
            loc = await ctx.resolver.locate(sid)
        except SandboxUnknown as exc:
            await self._deny(scope, receive, send, 502, responses.NOT_FOUND, sid,
                             code=error_code(exc.status, exc.error_code))
            return
        except (SandboxLost, SandboxStranded) as exc:   # "was not found": the SDKs' not running
            await self._deny(scope, receive, send, 502, f"{responses.NOT_FOUND}: {exc.message}",
                             sid, code=error_code(exc.status, exc.error_code))
            return
        except ClusterError as exc:   # Redis down: not the sandbox's fault
            await self._deny(scope, receive, send, exc.status, exc.message, sid,
                             code=error_code(exc.status, exc.error_code))
            return
        if by_headers and not routes_by_headers(host_name(header(scope, b"host") or ""),
                                                 None):
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"host"]
            scope["headers"].append((b"host", b"localhost"))
        try:
            if scope["type"] == "websocket":
                await relay_websocket(loc.node.proxy_address, scope, receive, send,
                                      sandbox_id=sid, tls=ctx.nodes.tls, metrics=self.metrics)
            else:
                await ctx.nodes.relay(loc.node.proxy_address, scope, receive, send,
                                      sandbox_id=sid)
        except ClusterError as exc:   # a node address the gateway cannot use
            await self._deny(scope, receive, send, 502, exc.message, sid,
                             code=error_code(exc.status, exc.error_code))


def build_gateway(cfg: GatewayConfig, *, keys: ApiKeys | None = None,
                  node_keys: NodeKeys | None = None, prefix: str = DEFAULT_PREFIX,
                  metrics: GatewayMetrics | None = None) -> Gateway:
    """The gateway for `cfg`; `keys` default to cfg.keys (created with one key if absent),
    `node_keys` to cfg.node_key_file (which must exist: a new key there would be one no
    node accepts); `metrics`: its registry (default: a new one), served at GET /metrics.
    ValueError: a key file is empty or missing, or the node key is also an API key."""
    return Gateway(cfg, keys or ApiKeys.load_or_create(cfg.keys),
                   node_keys or NodeKeys.load(cfg.node_key_file), prefix=prefix,
                   metrics=metrics)
