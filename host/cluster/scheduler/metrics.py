"""`SchedulerMetrics`: the scheduler's own Prometheus registry (host/metrics'
`ServiceMetrics`), served at `GET /metrics` by app.py. README.md lists the metrics.

    placements    counted and timed by `Scheduler.place` (service.py), by the request's
                  kind and outcome: placed, capacity (no node fits: the 429), error (an
                  unknown or lost sandbox, Redis failing)
    deaths        counted by the `Sweeper` (monitor.py) from what its sweep declared: the
                  sweep script is atomic, so with several replicas each death and loss is
                  counted once, by the replica whose sweep recorded it
    nodes         by state, read from the Redis index at each scrape (`node_counts`, also
                  the gateway's): bounded in time; a Redis failure or timeout leaves the
                  family out of that scrape (logged), the counters are still served

Labels are bounded: kinds and outcomes are fixed sets, states the registry's; never a
sandbox or node id.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from host.metrics import ServiceMetrics

from ..errors import NoCapacity
from ..registry import NodeState, Registry

PLACEMENT_KINDS = ("create", "resume", "fork")
OUTCOMES = ("placed", "capacity", "error")
NODE_STATES = tuple(s.value for s in NodeState)
# A placement is a few Redis round trips, behind this process's placement lock.
PLACEMENT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 15.0)
# What a scrape may spend reading the Redis index (Prometheus' default timeout is 10 s).
SCRAPE_TIMEOUT_S = 3.0


async def node_counts(registry: Registry, *,
                      timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, int]:
    """Nodes in the index by state (every state, 0 when none); raises when Redis fails
    or does not answer within `timeout_s` (TimeoutError)."""
    async with asyncio.timeout(timeout_s):
        nodes = await registry.nodes()
    counts = dict.fromkeys(NODE_STATES, 0)
    for node in nodes:
        counts[node.state.value] += 1
    return counts


def track_nodes(metrics: ServiceMetrics, counts: Callable[[], Awaitable[Mapping[str, int]]]
                ) -> None:
    """`aenv_cluster_nodes{state}` from `counts()` at each scrape (scheduler and gateway)."""
    metrics.track_counts("aenv_cluster_nodes",
                         "Nodes in the cluster's Redis index by state (ready, draining, "
                         "dead: dead ones until their retention ends)", "state", counts)


class SchedulerMetrics(ServiceMetrics):
    """The scheduler's registry and instruments."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.placements = Counter(
            "aenv_scheduler_placements_total",
            "Placement requests by kind (create, resume, fork) and outcome (placed; "
            "capacity: no node fits, the 429; error: unknown or lost sandbox, Redis failed)",
            ["kind", "outcome"], registry=r)
        self.placement_seconds = Histogram(
            "aenv_scheduler_placement_seconds",
            "Duration of placement requests, whatever their outcome (waiting for this "
            "process's placement lock included)",
            ["kind"], registry=r, buckets=PLACEMENT_BUCKETS_S)
        self.nodes_declared_dead = Counter(
            "aenv_scheduler_nodes_declared_dead_total",
            "Nodes this scheduler's sweeps declared dead (their heartbeats stopped)",
            registry=r)
        self.sandboxes_lost = Counter(
            "aenv_scheduler_sandboxes_lost_total",
            "Running sandboxes this scheduler's sweeps marked lost with their dead node",
            registry=r)
        for kind in PLACEMENT_KINDS:
            self.placement_seconds.labels(kind)
            for outcome in OUTCOMES:
                self.placements.labels(kind, outcome)

    @contextlib.contextmanager
    def placement(self, kind: str) -> Iterator[None]:
        """Time and count one placement of `kind` (one of PLACEMENT_KINDS): placed when
        the scope ends normally, capacity on NoCapacity, error on any other exception (a
        cancellation counts as neither)."""
        kind = kind if kind in PLACEMENT_KINDS else "other"   # bounded, whoever calls
        t0 = time.perf_counter()
        try:
            yield
        except NoCapacity:
            self._placed(kind, "capacity", t0)
            raise
        except Exception:
            self._placed(kind, "error", t0)
            raise
        else:
            self._placed(kind, "placed", t0)

    def _placed(self, kind: str, outcome: str, t0: float) -> None:
        self.placement_seconds.labels(kind).observe(time.perf_counter() - t0)
        self.placements.labels(kind, outcome).inc()

    def swept(self, dead: Mapping[str, int]) -> None:
        """Count one sweep's result: {node id: running sandboxes lost} of the nodes it
        declared dead."""
        if dead:
            self.nodes_declared_dead.inc(len(dead))
            self.sandboxes_lost.inc(sum(dead.values()))
