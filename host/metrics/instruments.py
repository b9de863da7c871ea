"""`Metrics`: one service instance's Prometheus registry and the instruments its layers update.

Each service builds one `Metrics` and hands it down at construction (orchestrator, runtime,
proxy middleware, the API's `/metrics` route): its own `CollectorRegistry`, never the
global default, so several services in one process (tests) do not see each other.

Two kinds of metrics live here. Events are counted where they happen: operation durations
and errors (`operation()`, used by the orchestrator), proxy requests and bytes (asgi.py).
State is read when Prometheus scrapes, by the collectors of collectors.py that the layers
register (`track_*`): sandboxes by state from the store, VM memory from /proc, cache and
repository counters from storage. `render()` refreshes those, then writes the text format.

`ServiceMetrics` is the registry part alone (`add_scraped`, `track_counts`, `render`): the
cluster gateway and scheduler build their own instruments on it (host/cluster), so their
pages do not carry the node's families.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .collectors import (
    LabelCountsCollector,
    SandboxStatesCollector,
    ScrapedCollector,
    StorageCollector,
    StorageUsage,
    VmMemoryCollector,
)
from .logs import sandbox_context

log = logging.getLogger(__name__)

# The sandbox operations timed by `operation()` (their series exist from the start, at 0).
OPERATIONS = ("create", "pause", "resume", "fork", "snapshot", "kill")
# From a warm restore under KVM (tens of ms) to a cold TCG boot or a fork of a big guest.
OPERATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# The operations being timed in the current task (see `Metrics.operation`).
_active: ContextVar[frozenset[str]] = ContextVar("aenv_operations", default=frozenset())


class ServiceMetrics:
    """One service instance's own registry, its scrape-time collectors and its page: the
    base of each service's instruments (`Metrics`: a node's; the cluster gateway's and
    scheduler's in host/cluster), so a service's page lists only its own metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._scraped: list[ScrapedCollector] = []

    def add_scraped(self, collector: ScrapedCollector) -> None:
        """Register a collector whose values `render()` refreshes before each scrape."""
        self.registry.register(collector)
        self._scraped.append(collector)

    def track_counts(self, name: str, documentation: str, label: str,
                     counts: Callable[[], Awaitable[Mapping[str, int]]]) -> None:
        """A gauge `name{label}` from `counts()` (label value -> number) at each scrape;
        left out of a scrape when `counts()` fails (bound its time in `counts`)."""
        self.add_scraped(LabelCountsCollector(name, documentation, label, counts))

    async def render(self) -> bytes:
        """The registry in Prometheus text format, scrape-time collectors refreshed first
        (a collector whose source fails is left out of this scrape and logged)."""
        await asyncio.gather(*(c.refresh() for c in self._scraped))
        return generate_latest(self.registry)


class Metrics(ServiceMetrics):
    """The registry and instruments of one node service instance."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.operation_seconds = Histogram(
            "aenv_sandbox_operation_seconds",
            "Duration of sandbox operations that succeeded (failures: "
            "aenv_sandbox_operation_errors_total)",
            ["operation"], registry=r, buckets=OPERATION_BUCKETS_S)
        self.operation_errors = Counter(
            "aenv_sandbox_operation_errors_total",
            "Sandbox operations that failed, by operation and error class",
            ["operation", "error"], registry=r)
        self.proxy_requests = Counter(
            "aenv_proxy_requests_total",
            "Requests through the sandbox proxy, by kind and status class "
            "(websocket: 1xx once accepted; none: the client left before an answer)",
            ["kind", "status"], registry=r)
        self.proxy_bytes = Counter(
            "aenv_proxy_bytes_total",
            "Body and WebSocket message bytes through the sandbox proxy "
            "(in: from clients, out: to clients)",
            ["direction"], registry=r)
        self.collected_records = Counter(
            "aenv_gc_records_total",
            "Records the node's collector deleted (sandboxes, events, idempotency keys past "
            "--retain-killed; snapshots nothing reaches)", ["kind"], registry=r)
        self.collected_files = Counter(
            "aenv_gc_files_total", "Layer files and memory dirs the node's collector removed",
            ["kind"], registry=r)
        self.collected_bytes = Counter(
            "aenv_gc_bytes_total", "Bytes of disk the node's collector freed", ["kind"],
            registry=r)
        self.held_bytes = Gauge(
            "aenv_storage_held_bytes",
            "Bytes on disk by kind (layers, memory; repository_* where the node owns its "
            "repository), as of the collector's last run", ["kind"], registry=r)
        self.drain_sandboxes = Gauge(
            "aenv_drain_sandboxes", "The node's stop-time drain (--drain-on-stop): sandboxes "
            "paused so far, failed to pause, and found running", ["state"], registry=r)
        self.drain_seconds = Gauge(
            "aenv_drain_seconds", "How long the node's drain has run (0: none)", registry=r)
        self.balloon_bytes = Gauge(
            "aenv_balloon_bytes", "Guest RAM the balloons of idle sandboxes hold (returned to "
            "the host under memory pressure; what guests free by themselves comes back "
            "through free-page reporting and shows in aenv_vm_memory_pss_bytes)", registry=r)
        self.balloon_sandboxes = Gauge(
            "aenv_balloon_sandboxes", "Running sandboxes whose balloon the node inflated",
            registry=r)
        for op in OPERATIONS:
            self.operation_seconds.labels(op)
        for direction in ("in", "out"):
            self.proxy_bytes.labels(direction)

    # ---- events -------------------------------------------------------------------------

    @contextlib.contextmanager
    def operation(self, name: str, sandbox_id: str | None = None) -> Iterator[None]:
        """Time one sandbox operation: its duration when it succeeds, its error class when
        it raises (a cancellation counts as neither). Log records inside carry
        `sandbox_id`. Nested scopes of the same operation (a pause request that ends in
        the pause every path shares) count once, in the outermost."""
        if name in _active.get():
            yield
            return
        ops = _active.set(_active.get() | {name})
        t0 = time.perf_counter()
        try:
            with sandbox_context(sandbox_id):
                yield
        except Exception as exc:
            self.operation_failed(name, exc)
            raise
        else:
            self.operation_seconds.labels(name).observe(time.perf_counter() - t0)
        finally:
            _active.reset(ops)

    def operation_failed(self, name: str, exc: BaseException) -> None:
        """Count a failure of operation `name` (label: the error's class name, a bounded
        set; never ids)."""
        self.operation_errors.labels(name, type(exc).__name__).inc()

    # ---- state read at scrape time ------------------------------------------------------

    def track_sandboxes(self, counts: Callable[[], Awaitable[Mapping[str, int]]]) -> None:
        """`aenv_sandboxes{state}` from `counts()` (state -> number) at each scrape."""
        self.add_scraped(SandboxStatesCollector(counts))

    def track_vms(self, pids: Callable[[], Iterable[int]]) -> None:
        """`aenv_vm_memory_pss_bytes`: the PSS of the VMM processes `pids()` names."""
        self.add_scraped(VmMemoryCollector(pids))

    def track_storage(self, usage: Callable[[], Awaitable[StorageUsage]]) -> None:
        """Cache and repository metrics from `usage()` at each scrape."""
        self.add_scraped(StorageCollector(usage))
