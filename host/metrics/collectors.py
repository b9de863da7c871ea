"""Collectors of state read at scrape time: nothing is counted twice, the source (the
orchestrator's store, the runtime's VMs, storage's own counters) is asked when Prometheus
scrapes.

Sources are async (the store answers on its own thread, the block server over its control
socket) while prometheus_client collects synchronously, so each `ScrapedCollector` is
refreshed by `Metrics.render()` right before the registry is written, and `collect()`
hands out what that refresh read. A source that fails is left out of that scrape (and
logged) rather than shown with stale values.

The values the runtime reports for storage are plain dataclasses (`StorageUsage`), so
no layer below needs prometheus_client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class ScrapedCollector(Collector):
    """A collector whose families `read()` (async) makes before each scrape."""

    def __init__(self) -> None:
        self._families: list[Metric] = []

    async def read(self) -> list[Metric]:
        raise NotImplementedError

    def families(self) -> list[Metric]:
        """The families this collector emits, without samples (for `describe`)."""
        raise NotImplementedError

    async def refresh(self) -> None:
        try:
            self._families = await self.read()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken source must not fail the scrape
            log.warning("metrics: %s failed: %s", type(self).__name__, exc)
            self._families = []

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)

    def describe(self) -> Iterator[Metric]:
        return iter(self.families())


# ---- sandboxes ------------------------------------------------------------------------

class SandboxStatesCollector(ScrapedCollector):
    """`aenv_sandboxes{state}`: the orchestrator's sandboxes by state, counted by its store."""

    def __init__(self, counts: Callable[[], Awaitable[Mapping[str, int]]]) -> None:
        super().__init__()
        self._counts = counts

    def families(self) -> list[Metric]:
        return [self._new()]

    @staticmethod
    def _new() -> GaugeMetricFamily:
        return GaugeMetricFamily("aenv_sandboxes",
                                 "Sandboxes on this node by state (killed ones not counted)",
                                 labels=["state"])

    async def read(self) -> list[Metric]:
        family = self._new()
        for state, n in sorted((await self._counts()).items()):
            family.add_metric([state], n)
        return [family]


class LabelCountsCollector(ScrapedCollector):
    """A gauge with one label, `name{label}`, from `counts()` (label value -> number): e.g.
    the cluster's nodes or sandboxes by state, counted in its Redis index."""

    def __init__(self, name: str, documentation: str, label: str,
                 counts: Callable[[], Awaitable[Mapping[str, int]]]) -> None:
        super().__init__()
        self._name, self._documentation, self._label = name, documentation, label
        self._counts = counts

    def families(self) -> list[Metric]:
        return [self._new()]

    def _new(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self._name, self._documentation, labels=[self._label])

    async def read(self) -> list[Metric]:
        family = self._new()
        for value, n in sorted((await self._counts()).items()):
            family.add_metric([value], n)
        return [family]


# ---- VM memory ------------------------------------------------------------------------

def pss_bytes(pid: int) -> int | None:
    """The proportional set size of process `pid` (shared pages split among their users,
    so a sum over VMs restored from one snapshot counts its page cache once), from
    /proc/<pid>/smaps_rollup (Linux 4.14+, one cheap read); None when unreadable (the
    process is gone, or not ours)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class VmMemoryCollector(ScrapedCollector):
    """`aenv_vm_memory_pss_bytes`: the PSS summed over the running VMs' VMM processes."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        super().__init__()
        self._pids = pids

    def families(self) -> list[Metric]:
        return [self._new()]

    @staticmethod
    def _new() -> GaugeMetricFamily:
        return GaugeMetricFamily("aenv_vm_memory_pss_bytes",
                                 "Proportional set size of the running VMs' VMM processes, "
                                 "summed")

    async def read(self) -> list[Metric]:
        pids = list(self._pids())  # on the loop: the runtime's tables are not thread-safe

        def total() -> int:
            return sum(n for n in map(pss_bytes, pids) if n is not None)

        family = self._new()
        family.add_metric([], await asyncio.to_thread(total))
        return [family]


# ---- storage --------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CacheUsage:
    """One bounded cache: its name (`chunks`: remote layer chunks; `memory`: local copies
    of memory snapshots), bytes held, bound, and lookups served locally or fetched."""

    name: str
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """Bytes one process moved to (upload) or from (download) a repository backend."""

    backend: str
    upload_bytes: int
    download_bytes: int


@dataclass(frozen=True)
class StorageUsage:
    """What the runtime reports for storage at a scrape (counters since each process
    started: the block server's restart resets its part, which Prometheus handles)."""

    caches: Sequence[CacheUsage] = ()
    transfers: Sequence[Transfer] = ()


class StorageCollector(ScrapedCollector):
    """Cache bytes, hits and misses; repository bytes by direction and backend."""

    def __init__(self, usage: Callable[[], Awaitable[StorageUsage]]) -> None:
        super().__init__()
        self._usage = usage

    def families(self) -> list[Metric]:
        return list(self._new())

    @staticmethod
    def _new() -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily,
                        CounterMetricFamily, CounterMetricFamily]:
        cache = ["cache"]
        return (
            GaugeMetricFamily("aenv_cache_used_bytes", "Bytes held by a node-local cache",
                              labels=cache),
            GaugeMetricFamily("aenv_cache_capacity_bytes", "Bound of a node-local cache",
                              labels=cache),
            CounterMetricFamily("aenv_cache_hits_total",
                                "Cache lookups served locally (hit ratio: hits / (hits + "
                                "misses))", labels=cache),
            CounterMetricFamily("aenv_cache_misses_total",
                                "Cache lookups fetched from the repository", labels=cache),
            CounterMetricFamily("aenv_repository_bytes_total",
                                "Bytes moved to (upload) or from (download) the repository",
                                labels=["direction", "backend"]),
        )

    async def read(self) -> list[Metric]:
        usage = await self._usage()
        used, capacity, hits, misses, repo = self._new()
        for c in usage.caches:
            used.add_metric([c.name], c.used_bytes)
            capacity.add_metric([c.name], c.capacity_bytes)
            hits.add_metric([c.name], c.hits)
            misses.add_metric([c.name], c.misses)
        totals: dict[tuple[str, str], int] = {}
        for t in usage.transfers:  # one per process and repository: summed per backend
            for direction, n in (("upload", t.upload_bytes), ("download", t.download_bytes)):
                key = (direction, t.backend)
                totals[key] = totals.get(key, 0) + n
        for (direction, backend), n in sorted(totals.items()):
            repo.add_metric([direction, backend], n)
        return [used, capacity, hits, misses, repo]
