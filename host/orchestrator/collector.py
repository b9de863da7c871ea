"""The node's collector: an owned background task that keeps what the node holds bounded.

Each run, in this order (each step frees what the next one may then take):
1. records: the rows of sandboxes killed longer ago than `retain_killed_s` and their
   events, and idempotency keys as old (GET of such a sandbox answers 404, as E2B's does
   once a sandbox is gone; listings never showed killed sandboxes);
2. snapshots: pause and fork snapshots nothing can reach, orphaned template snapshots
   (`snapshots.collect_snapshots`, also run at each kill; here it catches what recovery,
   handoffs and named snapshots' deletes left);
3. uploaded COPY archives unused for `files_ttl_s` (the SDK uploads one again when it
   asks and it is gone: templates/files.py);
4. storage: build-cache entries unused as long, then layers and memory files no
   document, stack, start or VM needs (`runtime.collect_storage`, host/runtime/collect.py).

A run and `aenv gc` (`POST /admin/gc`) share one lock: never two at once. A dry run counts
what a run would remove and removes nothing (step 4 then still counts what step 2's
snapshots hold as needed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from host import heap
from host.tasks import cancel_and_wait, run_every

from . import snapshots
from .opcontext import Context
from .templates import files as template_files

log = logging.getLogger(__name__)

STORAGE_KINDS = ("layers", "repository_layers", "memory", "repository_memory", "build_cache",
                 "copy_archives")


class Collector:
    def __init__(self, ctx: Context, *, interval_s: float, retain_killed_s: float,
                 files_ttl_s: float = 7 * 86400.0) -> None:
        self.ctx = ctx
        self.interval_s = interval_s
        self.retain_killed_s = retain_killed_s
        self.files_ttl_s = files_ttl_s
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.last: dict[str, Any] | None = None  # the last run's report

    def start(self) -> None:
        """Run every `interval_s` (the first run at once: it takes what a crash left);
        0 turns the periodic runs off (`run()` still works)."""
        if self._task is None and self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(
                run_every(self.interval_s, self.run, log=log, failed="collection failed"),
                name="collector")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def run(self, *, dry_run: bool = False) -> dict[str, Any]:
        """One collection; its report: {records, snapshots, storage, dry_run, seconds}."""
        async with self._lock:
            t0 = time.perf_counter()
            ctx = self.ctx
            before = time.time() - self.retain_killed_s  # the store's update times are wall-clock
            records = await ctx.db(ctx.store.prune_killed, before, dry_run=dry_run)
            collected = await snapshots.collect_snapshots(ctx, dry_run=dry_run)
            records["snapshots"] = len(collected)
            archives = await template_files.expire(ctx, self.files_ttl_s, dry_run=dry_run)
            storage: dict[str, Any] = {}
            collect = getattr(ctx.runtime, "collect_storage", None)
            if collect is not None:
                storage = await collect(dry_run=dry_run)
            storage["copy_archives"] = archives
            report = {"records": records, "storage": storage, "dry_run": dry_run,
                      "seconds": round(time.perf_counter() - t0, 3)}
            if not dry_run:
                self._count(report)
                self.last = report
                heap.trim()  # what the run and the work since freed goes back (host/heap.py)
            return report

    def _count(self, report: dict[str, Any]) -> None:
        m = self.ctx.metrics
        for kind, n in report["records"].items():
            m.collected_records.labels(kind).inc(n)
        for kind in STORAGE_KINDS:
            swept = report["storage"].get(kind)
            if swept:
                m.collected_files.labels(kind).inc(swept["files"])
                m.collected_bytes.labels(kind).inc(swept["bytes"])
        held = report["storage"].get("held") or {}
        for kind, n in held.items():
            m.held_bytes.labels(kind).set(n)
