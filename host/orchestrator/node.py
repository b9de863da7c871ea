"""`NodeOrchestrator`: the E2B sandbox semantics over the state store and a `SandboxRuntime`.

Every operation follows one pattern (STYLE.md): take the sandbox's lock, move it durably to
a transitional state (store.transition), do the machine work through the runtime, then
move it to the final state, or back where it came from on failure. Operations run as tasks
owned by the orchestrator and callers await them through `asyncio.shield`, so a client that
disconnects never half-finishes a VM operation. Requests for one sandbox are serialized by
its lock; one that no longer fits the state it finds raises `StateConflict` (409).

This class is the facade: it owns the tasks, the TTL loop (ttl.py) and the `Context` the
operations share (opcontext.py), serves get/list, and hands every other operation to the
module of its job: lifecycle.py (create, kill), pausing.py (pause, connect), snapshots.py,
forks.py, timeouts.py (TTLs, expiry, VMs that exited), guest_access.py (metrics, logs,
network, route), and for templates the templates/ package: builds.py (request, start, status),
lookup.py (list, get, delete, aliases, tags), files.py (COPY uploads) and builtin.py.
Recovery after a restart is in recovery.py (sandboxes) and templates/builds.recover (builds).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import time
from collections.abc import AsyncIterable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from host.contract import MachineSpec, NetworkConfig, SandboxRuntime
from host.hostmem import node_available_mib
from host.metrics import Metrics
from host.volumes import Volumes

from . import drain as drain_
from . import forks, guest_access, handoff, lifecycle, mounts, pausing, snapshots, timeouts
from .admission import Admission, AdmissionPolicy
from .balloons import Balloons
from .collector import Collector
from .envd import EnvdClient
from .errors import OperationFailed, OrchestratorError
from .kept import KeptVms
from .model import (
    BuildRequest,
    BuildStart,
    BuildStatus,
    CreateRequest,
    ForkResult,
    ListFilter,
    LogLine,
    Metric,
    RequestedBuild,
    Route,
    SandboxInfo,
    SnapshotInfo,
    TemplateInfo,
    TemplateTag,
)
from .opcontext import Context
from .pressure import PressureGuard, PressurePolicy
from .records import expand_states, sandbox_info
from .recovery import recover as run_recovery
from .states import SandboxState
from .store import Store
from .templates import (
    builds,
)
from .templates import (
    builtin as builtin_templates,
)
from .templates import (
    files as template_files,
)
from .templates import (
    lookup as templates,
)
from .templates.store import TemplateStore
from .ttl import TtlLoop
from .warm import WarmPool

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TEMPLATE = "base"
KILL_RETRY_S = 10.0  # a sandbox `killing` for longer: its kill failed, the TTL loop retries


class NodeOrchestrator:
    """Implements `host.orchestrator.service.Orchestrator` for the sandboxes of one node.

    Call `await start()` (recovery, then the TTL loop) before serving and `await aclose()`
    after. The store and the runtime belong to the caller. `files_dir` holds the uploaded
    COPY archives of template builds (default: `template-files` next to the database).
    `metrics`: the service's (operations are timed there, and it reads the sandboxes by
    state from the store at each scrape); by default one of its own. `warm_pool`: how
    many VMs of the template creates came from last are kept restored for the next
    creates (warm.py; 0: none). `keep_paused_s`: how long a paused sandbox's VM stays,
    stopped, for a fast resume (kept.py; 0: not at all).
    """

    def __init__(self, store: Store, runtime: SandboxRuntime, *, domain: str | None = None,
                 default_template: str = DEFAULT_TEMPLATE,
                 template_aliases: Sequence[str] = ("base", "default"),
                 machine: MachineSpec | None = None, envd: EnvdClient | None = None,
                 default_timeout_s: int = 300, max_timeout_s: int = 24 * 3600,
                 clock: Callable[[], float] = time.time,
                 files_dir: Path | None = None, builtin_cache: Path | None = None,
                 admission: AdmissionPolicy | None = None,
                 pressure: PressurePolicy | None = None,
                 metrics: Metrics | None = None, handoff: bool = False,
                 warm_pool: int = 0, keep_paused_s: float = 0.0,
                 gc_interval_s: float = 0.0, retain_killed_s: float = 86400.0,
                 build_cache_ttl_s: float = 7 * 86400.0,
                 volumes_dir: Path | None = None) -> None:
        self.domain = domain
        # the host-side inputs of built-in templates (pip trees, archives): like the
        # kernel and image, reusable across state dirs
        self.builtin_cache = builtin_cache or Path(os.environ.get("AENV_CACHE",
                                                                  "/var/cache/aenv"))
        self.state_dir = store.path.parent  # the API keeps its upload-signing key here
        self.store = store
        self.runtime = runtime
        self.default_template = default_template
        self.machine = machine or MachineSpec()
        self.envd = envd or EnvdClient()
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.clock = clock
        # not `self.metrics`: that is the sandbox metrics call of the E2B API
        self.service_metrics = metrics if metrics is not None else Metrics()
        self.service_metrics.track_sandboxes(self.state_counts)
        self._ctx = Context(
            store=store, runtime=runtime, envd=self.envd, spawn=self.spawn, clock=clock,
            machine=self.machine, default_template=default_template,
            template_aliases=frozenset({"", default_template, *template_aliases}),
            default_timeout_s=default_timeout_s, max_timeout_s=max_timeout_s,
            templates=TemplateStore(store),
            files_dir=files_dir or self.state_dir / "template-files",
            admission=Admission(admission), metrics=self.service_metrics, handoff=handoff)
        self._runs = self._ctx.runs  # the proxy's run events (Context.end_run)
        # E2B volumes (host/volumes): records and bytes in volumes_dir (__main__: in a
        # posix_fs repository, so that the nodes sharing it share the volumes)
        self.volumes = Volumes(volumes_dir or self.state_dir / "volumes", clock=clock)
        self._ctx.volumes = self.volumes
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ttl: TtlLoop | None = None
        self._pressure_policy = pressure
        self.pressure: PressureGuard | None = None
        self.warm = WarmPool(self._ctx, warm_pool, room=self._room_for_warm)
        self._ctx.warm = self.warm
        self.kept = KeptVms(self._ctx, keep_paused_s, room=self._room_for_warm)
        self.balloons = Balloons(runtime, self._ctx.activity, clock=clock)
        self.collector = Collector(self._ctx, interval_s=gc_interval_s,
                                   retain_killed_s=retain_killed_s,
                                   files_ttl_s=build_cache_ttl_s)
        self._ctx.kept = self.kept
        self._ctx.admission.spare = self.release_spare
        self.service_metrics.track_counts(
            "aenv_spare_vms", "VMs this node holds for speed, given back first under "
            "memory pressure: warm (restored ahead for creates), kept (paused sandboxes' "
            "VMs, for fast resumes)", "kind", self.spare_counts)
        self._closed = False

    # ---- lifecycle of the orchestrator -------------------------------------------------

    async def start(self, *, ttl_interval_s: float = 1.0, recover: bool = True,
                    resume_drained: bool = True) -> None:
        """Recover the store against reality (recovery.py), then start the TTL loop.
        `resume_drained=False`: the caller calls `resume_drained()` later (a cluster
        node, after its first heartbeat)."""
        if recover:
            await asyncio.to_thread(self.volumes.sweep)
            await run_recovery(self.store, self.runtime, self.envd, clock=self.clock)
            await builds.recover(self._ctx)
            await mounts.serve_running(self._ctx)
        self._ttl = TtlLoop(self, interval_s=ttl_interval_s)
        self._ttl.start()
        self.collector.start()
        if resume_drained:
            self.resume_drained()
        if self._pressure_policy is not None:
            self.pressure = PressureGuard(self, self._pressure_policy)
            self.pressure.start()

    def resume_drained(self) -> None:
        """Resume, in the background, what the last stop's drain paused (drain.py). In a
        cluster, only once the node's first heartbeat was taken: another node may have
        taken over some of those sandboxes while this one was away (their connects went
        there, from the handoffs the drain left), and that heartbeat is what makes this
        node forget them (heartbeat.py); resumed before it, each would run twice."""
        self.spawn(drain_.resume_drained(self._ctx,
                                         concurrency=self._ctx.admission.policy.max_starts))

    async def aclose(self, *, grace_s: float = 30.0) -> None:
        """Stop the TTL loop, let in-flight operations finish (up to `grace_s`), cancel the
        rest (recovery settles them at the next start), close the envd client."""
        if self._closed:
            return
        self._closed = True
        if self._ttl is not None:
            await self._ttl.aclose()
        await self.collector.aclose()
        if self.pressure is not None:
            await self.pressure.aclose()
        await self.warm.aclose()
        await self.kept.aclose()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self.volumes.aclose()   # the guests' volume servers (a restart serves them again)
        await self.envd.aclose()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `coro` as a task owned by the orchestrator (awaited or cancelled by aclose)."""
        if self._closed:
            coro.close()
            raise OperationFailed("the orchestrator is shutting down")
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Retrieved here so that an operation whose caller went away logs once.
            exc = task.exception()
            if not isinstance(exc, OrchestratorError):
                log.error("orchestrator task failed", exc_info=exc)

    # ---- read --------------------------------------------------------------------------

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return sandbox_info(await self._ctx.record(sandbox_id), now=self.clock())

    async def spare_counts(self) -> dict[str, int]:
        """The warm and kept VMs held now; read at each metrics scrape."""
        return {"warm": len(self.warm.ready), "kept": len(self.kept.until)}

    async def state_counts(self) -> dict[str, int]:
        """How many sandboxes are in each state but `killed` (every state listed, 0
        included, so each series exists from the start); read at each metrics scrape."""
        rows = await self._ctx.db(self.store.select,
                                  "SELECT state, COUNT(*) FROM sandboxes GROUP BY state")
        counts = {s.value: 0 for s in SandboxState if s is not SandboxState.KILLED}
        counts.update({str(state): int(n) for state, n in rows if state in counts})
        return counts

    async def list(self, flt: ListFilter) -> Sequence[SandboxInfo]:
        recs = await self._ctx.db(self.store.list_sandboxes, expand_states(flt.states))
        now = self.clock()
        out = []
        for rec in recs:
            if any(rec.metadata.get(k) != v for k, v in flt.metadata.items()):
                continue
            if flt.template and flt.template not in (rec.template_id, rec.alias):
                continue
            if flt.started_after is not None and rec.started_at <= flt.started_after:
                continue
            out.append(sandbox_info(rec, now=now))
        return out

    # ---- create, kill (lifecycle.py) ---------------------------------------------------

    async def create(self, req: CreateRequest) -> SandboxInfo:
        await builtin_templates.ensure(self._ctx, req.template_id, self.builtin_cache)
        return await lifecycle.create(self._ctx, req)

    async def kill(self, sandbox_id: str) -> None:
        await lifecycle.kill(self._ctx, sandbox_id)

    # ---- TTL (timeouts.py) -------------------------------------------------------------

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        await timeouts.set_timeout(self._ctx, sandbox_id, timeout_s)

    async def extend_timeout(self, sandbox_id: str, duration_s: int) -> None:
        """Keep alive for at least `duration_s` more seconds (never shortens)."""
        await timeouts.extend_timeout(self._ctx, sandbox_id, duration_s)

    async def vm_exited(self, sandbox_id: str) -> str | None:
        """Settle a running sandbox whose VM ended by itself (paused or killed); returns
        the new state, or None when nothing was to be done."""
        return await timeouts.vm_exited(self._ctx, sandbox_id)

    async def unfinished_kills(self) -> builtins.list[str]:
        """Sandboxes a failed kill left `killing` over KILL_RETRY_S ago."""
        return await lifecycle.unfinished_kills(self._ctx, KILL_RETRY_S)

    async def retry_kill(self, sandbox_id: str) -> str | None:
        return await lifecycle.retry_kill(self._ctx, sandbox_id)

    async def expired(self) -> builtins.list[str]:
        """Running sandboxes whose TTL has run out."""
        return await timeouts.expired(self._ctx)

    async def expire(self, sandbox_id: str) -> str | None:
        """Pause (autoPause) or kill a sandbox whose TTL ran out; returns "paused",
        "killed" or None (not expired any more)."""
        return await timeouts.expire(self._ctx, sandbox_id)

    # ---- memory pressure (pressure.py) -------------------------------------------------

    async def coldest_running(self) -> builtins.list[str]:
        """Running sandboxes, longest without a request through the proxy first."""
        running = await self._ctx.db(self.store.list_sandboxes, {SandboxState.RUNNING})
        activity = self._ctx.activity
        for gone in set(activity) - {r.id for r in running}:
            activity.pop(gone, None)
        return [r.id for r in sorted(running, key=lambda r: activity.get(r.id, r.started_at))]

    async def reclaim_idle(self, need_mib: int) -> int:
        """Inflate the balloons of the coldest running sandboxes (balloons.py); the MiB
        their guests gave back."""
        got = await self.balloons.reclaim(await self.coldest_running(), need_mib)
        self._balloon_gauges()
        return got

    async def deflate_active(self) -> builtins.list[str]:
        if not self.balloons.inflated:  # every tick: no store read when nothing to do
            return []
        running = await self._ctx.db(self.store.list_sandboxes, {SandboxState.RUNNING})
        out = await self.balloons.release_active({r.id for r in running})
        self._balloon_gauges()
        return out

    def _balloon_gauges(self) -> None:
        m = self.service_metrics
        m.balloon_bytes.set(self.balloons.returned_mib << 20)
        m.balloon_sandboxes.set(len(self.balloons.inflated))

    async def pause_for_memory(self, sandbox_id: str) -> None:
        # to free memory: answered once committed, its VM not kept
        await pausing.pause(self._ctx, sandbox_id, memory=True, early=False, keep=False)

    async def release_spare(self) -> int:
        """Release the warm VMs (warm.py) and the kept VMs of paused sandboxes (kept.py)
        before any sandbox is paused for memory or a start is refused."""
        return await self.warm.drain() + await self.kept.drain()

    def _room_for_warm(self, memory_mb: int) -> bool:
        """A warm VM is restored, and a paused sandbox's VM kept, only while the node
        keeps well clear of memory pressure."""
        admission = self._ctx.admission.policy
        floor = (self._pressure_policy.high_mib if self._pressure_policy is not None
                 else admission.reserve_mib)
        return node_available_mib() - admission.need_mib(memory_mb) > floor

    # ---- pause / resume (pausing.py) ---------------------------------------------------

    async def pause(self, sandbox_id: str, *, memory: bool = True,
                    require_healthy: bool = False) -> None:
        """Pause: memory + disk, or `memory=False`: the disk alone (resume cold-boots it).
        A filesystem-only pause, and one with `require_healthy`, needs envd to answer."""
        await pausing.pause(self._ctx, sandbox_id, memory=memory,
                            require_healthy=require_healthy)

    async def connect(self, sandbox_id: str, timeout_s: int | None, *,
                      memory: bool = True) -> tuple[SandboxInfo, bool]:
        """Resume a paused sandbox (or extend a running one's TTL); `memory=False` resumes
        by a reboot of its disk."""
        return await pausing.connect(self._ctx, sandbox_id, timeout_s, memory=memory)

    # ---- cluster handoffs (handoff.py) -------------------------------------------------

    async def adopt(self, sandbox_id: str) -> SandboxInfo:
        """Take over a paused sandbox another node left in the shared repository."""
        return await self._ctx.shielded(handoff.adopt(self._ctx, sandbox_id))

    async def forget(self, sandbox_id: str) -> bool:
        """Drop the records of a paused sandbox another node took over."""
        return await self._ctx.shielded(handoff.forget(self._ctx, sandbox_id))

    # ---- snapshots (snapshots.py), fork (forks.py) -------------------------------------

    async def snapshot(self, sandbox_id: str, name: str | None) -> SnapshotInfo:
        return await snapshots.snapshot(self._ctx, sandbox_id, name)

    async def list_snapshots(self, sandbox_id: str | None,
                             name: str | None) -> Sequence[SnapshotInfo]:
        return await snapshots.list_snapshots(self._ctx, sandbox_id, name)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await snapshots.delete_snapshot(self._ctx, snapshot_id)

    async def collect(self, *, dry_run: bool = False) -> dict[str, Any]:
        """One run of the node's collector (collector.py): its report."""
        return await self.collector.run(dry_run=dry_run)

    def health(self) -> builtins.list[str]:
        """Why this node should take no new sandboxes now ([] when healthy): its state
        dir's disk under the admission floor, a drain."""
        problems = ["draining: the node is stopping and pauses its sandboxes"] \
            if self._ctx.admission.draining else []
        problem = self._ctx.admission.disk_problem()
        return problems + ([problem] if problem else [])

    async def drain(self) -> drain_.DrainReport:
        """Before a stop that takes the VMs with it: refuse starts, pause every running
        sandbox with its memory (drain.py); the next start resumes them."""
        admission = self._ctx.admission
        admission.draining = True
        return await drain_.drain(self._ctx, release_spare=await self.release_spare(),
                                  concurrency=admission.policy.max_starts)

    async def fork(self, sandbox_id: str, count: int, timeout_s: int | None) -> Sequence[ForkResult]:
        return await forks.fork(self._ctx, sandbox_id, count, timeout_s)

    # ---- observability, network, routing (guest_access.py) ------------------------------------

    async def metrics(self, sandbox_id: str) -> Sequence[Metric]:
        return await guest_access.metrics(self._ctx, sandbox_id)

    async def logs(self, sandbox_id: str, start_ms: int | None, limit: int) -> Sequence[LogLine]:
        return await guest_access.logs(self._ctx, sandbox_id, start_ms, limit)

    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None:
        await guest_access.update_network(self._ctx, sandbox_id, network)

    async def route(self, sandbox_id: str, port: int, *, resume: bool) -> Route:
        route = await guest_access.route(self._ctx, sandbox_id, port, resume=resume)
        # its coldness (pressure.py); only once it is known to run here: the proxy asks
        # for any id a request names, with no key
        self._ctx.activity[sandbox_id] = self.clock()
        return route

    # ---- templates (templates/: builds.py, lookup.py, files.py) ------------------------

    async def request_build(self, req: BuildRequest) -> RequestedBuild:
        return await builds.request_build(self._ctx, req)

    async def start_build(self, template_id: str, build_id: str, start: BuildStart) -> None:
        if start.from_template:
            await builtin_templates.ensure(self._ctx, start.from_template, self.builtin_cache)
        await builds.start_build(self._ctx, template_id, build_id, start)

    async def build_status(self, template_id: str, build_id: str, *, offset: int = 0,
                           limit: int = 100, level: str | None = None) -> BuildStatus:
        return await builds.build_status(self._ctx, template_id, build_id, offset=offset,
                                         limit=limit, level=level)

    async def list_templates(self) -> Sequence[TemplateInfo]:
        return await templates.list_templates(self._ctx)

    async def get_template(self, template_id: str) -> TemplateInfo:
        return await templates.get_template(self._ctx, template_id)

    async def delete_template(self, template_id: str) -> None:
        """A built template, else a named snapshot (`Sandbox.delete_snapshot` calls
        DELETE /templates/{id} too)."""
        if not await templates.delete_template(self._ctx, template_id):
            await snapshots.delete_snapshot(self._ctx, template_id)

    async def template_alias(self, alias: str) -> tuple[str, bool]:
        return await templates.alias_info(self._ctx, alias)

    async def assign_tags(self, target: str,
                          tags: Sequence[str]) -> tuple[str, builtins.list[str]]:
        return await templates.assign_tags(self._ctx, target, builtins.list(tags))

    async def remove_tags(self, name: str, tags: Sequence[str]) -> None:
        await templates.remove_tags(self._ctx, name, builtins.list(tags))

    async def list_tags(self, template_id: str) -> Sequence[TemplateTag]:
        return await templates.list_tags(self._ctx, template_id)

    async def template_file(self, template_id: str, files_hash: str) -> bool:
        """Whether the COPY archive `files_hash` is here (400 bad hash, 404 template)."""
        return await template_files.template_file(self._ctx, template_id, files_hash)

    async def put_template_file(self, files_hash: str, chunks: AsyncIterable[bytes], *,
                                max_bytes: int) -> int:
        return await template_files.put_file(self._ctx, files_hash, chunks,
                                             max_bytes=max_bytes)
