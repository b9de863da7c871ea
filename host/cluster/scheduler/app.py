"""The scheduler's HTTP API (starlette; served on :9090 by __main__.py).

    GET  /health       200 {"status": "ok"} while Redis answers, else 503
    GET  /metrics      Prometheus text format (metrics.py), no key needed
    POST /placements   {"kind": "create" | "fork" | "resume", "sandboxID"?, "exclude"?: [node
                       ids], "memoryMiB"?} -> 201 {"nodeID", "address", "proxyAddress",
                       "placementID"}; 429 (E2B's capacity error) when no node fits, 404 /
                       410 for a fork or resume of an unknown or lost sandbox

Stateless: everything it knows is in Redis, so replicas may run side by side. With a node
key file, every route but /health and /metrics (host/api/auth.py's open paths) wants the
cluster's node key in X-API-Key (what the gateway sends); no client's API key opens it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from host.api.auth import ApiKeyMiddleware, NodeKeys
from host.api.errors import error_response
from host.metrics import metrics_route

from ..config import SchedulerConfig
from ..errors import ClusterError, error_reply
from ..placement import Demand
from ..registry import Registry
from ..store import DEFAULT_PREFIX, ClusterStore
from .metrics import SchedulerMetrics, node_counts, track_nodes
from .monitor import Sweeper
from .service import KINDS, PlacementRequest, Scheduler


def _bad(message: str) -> Response:
    return error_response(400, message)


def _request(data: Any) -> PlacementRequest | str:
    """The placement request in `data`, or what is wrong with it."""
    if not isinstance(data, dict):
        return "the body must be a JSON object"
    kind = data.get("kind", "create")
    if kind not in KINDS:
        return f"'kind' must be one of {', '.join(KINDS)}, got {kind!r}"
    sid = data.get("sandboxID")
    if sid is not None and (not isinstance(sid, str) or not sid):
        return "'sandboxID' must be a non-empty string"
    exclude = data.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
        return "'exclude' must be an array of node ids"
    mib = data.get("memoryMiB")
    if mib is not None and (isinstance(mib, bool) or not isinstance(mib, int) or mib < 1):
        return "'memoryMiB' must be a positive integer"
    return PlacementRequest(kind=kind, sandbox_id=sid, exclude=tuple(exclude), memory_mib=mib)


async def place(request: Request) -> Response:
    try:
        data = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        return _bad(f"the body is not valid JSON: {exc}")
    req = _request(data)
    if isinstance(req, str):
        return _bad(req)
    scheduler: Scheduler = request.app.state.scheduler
    try:
        placement = await scheduler.place(req)
    except ClusterError as exc:
        return error_reply(exc, method="POST")
    return JSONResponse(placement.wire(), status_code=201)


async def health(request: Request) -> Response:
    store: ClusterStore = request.app.state.store
    try:
        await store.ping()
    except ClusterError as exc:
        return error_reply(exc)
    return JSONResponse({"status": "ok"})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail))


def build_scheduler_app(cfg: SchedulerConfig, *, prefix: str = DEFAULT_PREFIX,
                        placement_ttl_s: float = 60.0,
                        metrics: SchedulerMetrics | None = None) -> Starlette:
    """The scheduler; its Redis client and sweeper live in the ASGI lifespan (serve it
    with lifespan="on"). `metrics`: its registry (default: a new one), at GET /metrics."""
    metrics = metrics if metrics is not None else SchedulerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = ClusterStore.from_url(cfg.redis, prefix=prefix)
        registry = Registry(store)
        sweeper = Sweeper(registry, interval_s=cfg.sweep_s, retention_s=cfg.retention_s,
                          metrics=metrics)
        app.state.store = store
        app.state.registry = registry
        app.state.scheduler = Scheduler(registry, strategy=cfg.strategy,
                                        demand=Demand(cfg.sandbox_mib),
                                        placement_ttl_s=placement_ttl_s, metrics=metrics)
        app.state.sweeper = sweeper
        sweeper.start()
        try:
            yield
        finally:
            try:
                await sweeper.aclose()
            finally:
                await store.aclose()

    middleware = []
    if cfg.node_key_file is not None:   # /metrics is one of its open paths, as /health
        middleware.append(Middleware(ApiKeyMiddleware, keys=None,
                                     node_keys=NodeKeys.load(cfg.node_key_file)))
    app = Starlette(routes=[Route("/health", health, methods=["GET"]),
                            Route("/placements", place, methods=["POST"]),
                            metrics_route(metrics)],
                    middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.metrics = metrics

    async def nodes_by_state() -> dict[str, int]:
        return await node_counts(app.state.registry)   # set by the lifespan

    track_nodes(metrics, nodes_by_state)
    return app
