"""`GatewayMetrics`: the gateway's own Prometheus registry (host/metrics'
`ServiceMetrics`), served at `GET /metrics` by app.py. README.md lists the metrics.

Where they are counted:

    requests, bytes   around the API and the sandbox traffic (app.py, host/metrics'
                      `ExchangeMetrics`: status class when each request or WebSocket
                      session ends; body and message bytes of traffic as they pass)
    node calls        `NodeClient.call` (forward.py): each API call into a node that got an
                      answer, whatever its status, by operation group
    placements        the time one create (or resume elsewhere) spent asking the scheduler,
                      every attempt summed, whatever the outcome (sandboxes.py)
    errors            the errors the gateway answers itself (not a node's answers passed
                      on), by E2B `error_code`, or the status's name when the error has none
    index             nodes and sandboxes by state, read from Redis at each scrape, bounded
                      in time: a Redis failure or timeout leaves those families out of that
                      scrape (logged), the rest is still served

Labels are bounded: fixed kinds, operation groups and states, status classes, error codes;
never a sandbox or node id.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus

from prometheus_client import CollectorRegistry, Counter, Histogram

from host.metrics import ServiceMetrics

from ..registry import BindingState, Registry
from ..scheduler.metrics import SCRAPE_TIMEOUT_S, node_counts, track_nodes
from ..store import ClusterStore, redis_errors

REQUEST_KINDS = ("api", "sandbox-http", "websocket")
# API calls into nodes, grouped: connect covers POST connect and POST resume; other: gets,
# timeouts, forks, logs, metrics, snapshots, template deletes, unbound-sandbox lookups
OPERATIONS = ("create", "connect", "pause", "kill", "list", "other")
PLACEMENT_KINDS = ("create", "resume")
BINDING_STATES = tuple(s.value for s in BindingState)
# From a listing of an idle node (ms) to a create or resume of a big guest (tens of s).
NODE_CALL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                       30.0, 60.0, 120.0)
PLACEMENT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 15.0)
_CHUNK = 1000   # binding reads per pipeline


def error_code(status: int, code: str | None = None) -> str:
    """The `code` label of an error: its E2B `error_code`, else its status's name
    (`not_found`, `unauthorized`, ...; `http_<status>` for a status without one)."""
    if code:
        return code
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


async def binding_counts(store: ClusterStore, *,
                         timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, int]:
    """Sandboxes bound in the index by state (every state, 0 when none): the sandboxes of
    every node's set, each counted once by its binding's state. Raises when Redis fails
    or does not answer within `timeout_s`."""
    redis, keys = store.redis, store.keys
    counts = dict.fromkeys(BINDING_STATES, 0)
    async with asyncio.timeout(timeout_s), redis_errors("counting sandboxes by state"):
        node_ids = sorted(str(m) for m in await redis.smembers(keys.nodes))
        pipe = redis.pipeline(transaction=False)
        for nid in node_ids:
            pipe.smembers(keys.node_sandboxes(nid))
        sets = await pipe.execute() if node_ids else []
        sids = sorted({str(sid) for members in sets for sid in members})
        for i in range(0, len(sids), _CHUNK):
            pipe = redis.pipeline(transaction=False)
            for sid in sids[i:i + _CHUNK]:
                pipe.hget(keys.sandbox(sid), "state")
            for state in await pipe.execute():
                if state in counts:
                    counts[state] += 1
    return counts


class Stopwatch:
    """Seconds spent in `running()` scopes, summed (the scheduler asks of one create)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0


class GatewayMetrics(ServiceMetrics):
    """The gateway's registry and instruments."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.requests = Counter(
            "aenv_gateway_requests_total",
            "Requests through the gateway by kind (api; sandbox-http and websocket: sandbox "
            "traffic) and status class (websocket: 1xx once accepted; none: the client left "
            "before an answer), counted when they end; /health and /metrics not counted",
            ["kind", "status"], registry=r)
        self.sandbox_bytes = Counter(
            "aenv_gateway_sandbox_bytes_total",
            "Body and WebSocket message bytes of sandbox traffic through the gateway "
            "(in: from clients, out: to clients), counted as they pass",
            ["direction"], registry=r)
        self.node_call_seconds = Histogram(
            "aenv_gateway_node_call_seconds",
            "Duration of API calls the gateway made into nodes that answered (any status), "
            "by operation group",
            ["operation"], registry=r, buckets=NODE_CALL_BUCKETS_S)
        self.placement_seconds = Histogram(
            "aenv_gateway_placement_seconds",
            "Time one create (or resume on another node) spent asking the scheduler, "
            "attempts summed, whatever the outcome",
            ["kind"], registry=r, buckets=PLACEMENT_BUCKETS_S)
        self.errors = Counter(
            "aenv_gateway_errors_total",
            "Errors the gateway answered itself (not nodes' answers passed on), by E2B "
            "error_code or, without one, the status's name",
            ["code"], registry=r)
        for direction in ("in", "out"):
            self.sandbox_bytes.labels(direction)
        for op in OPERATIONS:
            self.node_call_seconds.labels(op)
        for kind in PLACEMENT_KINDS:
            self.placement_seconds.labels(kind)

    def error(self, status: int, code: str | None = None) -> None:
        """Count one error the gateway answered (label: `error_code(status, code)`)."""
        self.errors.labels(error_code(status, code)).inc()

    def node_call(self, operation: str, seconds: float) -> None:
        op = operation if operation in OPERATIONS else "other"
        self.node_call_seconds.labels(op).observe(seconds)

    def placed(self, kind: str, seconds: float) -> None:
        self.placement_seconds.labels(kind if kind in PLACEMENT_KINDS else "create"
                                      ).observe(seconds)

    def track_cluster(self, source: Callable[[], Registry]) -> None:
        """`aenv_cluster_nodes{state}` and `aenv_cluster_sandboxes{state}` at each scrape,
        from the Redis index `source()` returns (its registry; raises while there is
        none: the families are left out)."""

        async def nodes() -> dict[str, int]:
            return await node_counts(source())

        async def sandboxes() -> dict[str, int]:
            return await binding_counts(source().store)

        track_nodes(self, nodes)
        self.track_counts("aenv_cluster_sandboxes",
                          "Sandboxes in the cluster's Redis index by binding state "
                          "(running, paused; lost: was running on a node that died, kept "
                          "until the retention ends)", "state", sandboxes)
