"""`NodeOrchestrator`: the E2B sandbox semantics over the state store and a `SandboxRuntime`.

Every operation follows one pattern (STYLE.md): take the sandbox's lock, move it durably to
a transitional state (store.transition), do the machine work through the runtime, then
move it to the final state, or back where it came from on failure. Operations run as tasks
owned by the orchestrator and callers await them through `asyncio.shield`, so a client that
disconnects never half-finishes a VM operation. Requests for one sandbox are serialized by
its lock; one that no longer fits the state it finds raises `StateConflict` (409).

TTL: a running sandbox has `end_at`; pausing stores the TTL left (`ttl_left_s`) and clears
`end_at`, so time spent paused does not count. The TTL loop (ttl.py) pauses (autoPause,
default) or kills expired sandboxes. Recovery after a restart is in recovery.py.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from host.contract import MachineSpec, SandboxRuntime, SnapshotRef

from . import ids
from .envd import EnvdClient
from .errors import (
    GuestUnresponsive,
    IdempotencyMismatch,
    InvalidRequest,
    OperationFailed,
    OrchestratorError,
    SandboxNotFound,
    SnapshotNotFound,
    StateConflict,
)
from .model import (
    CreateRequest,
    ForkResult,
    ListFilter,
    LogLine,
    Metric,
    NetworkConfig,
    Route,
    RunEnded,
    SandboxInfo,
    SnapshotInfo,
)
from .records import (
    GONE,
    LIVE,
    expand_states,
    network_from_json,
    network_to_json,
    placement_of,
    placement_to_json,
    ref_to_json,
    sandbox_info,
    snapshot_info,
    snapshot_ref,
    with_runtime,
)
from .states import SandboxState as S
from .store import SandboxRecord, SnapshotRecord, Store

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TEMPLATE = "base"
MAX_FORK = 16


class NodeOrchestrator:
    """Implements `host.orchestrator.service.Orchestrator` for the sandboxes of one node.

    Call `await start()` (recovery, then the TTL loop) before serving and `await aclose()`
    after. The store and the runtime belong to the caller.
    """

    def __init__(self, store: Store, runtime: SandboxRuntime, *, domain: str | None = None,
                 default_template: str = DEFAULT_TEMPLATE,
                 template_aliases: Sequence[str] = ("base", "default"),
                 machine: MachineSpec | None = None, envd: EnvdClient | None = None,
                 default_timeout_s: int = 300, max_timeout_s: int = 24 * 3600,
                 clock: Callable[[], float] = time.time) -> None:
        self.domain = domain
        self.store = store
        self.runtime = runtime
        self.default_template = default_template
        self._aliases = frozenset({"", default_template, *template_aliases})
        self.machine = machine or MachineSpec()
        self.envd = envd or EnvdClient()
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idempotent: dict[str, asyncio.Task[SandboxInfo]] = {}
        # One event per running incarnation that the proxy was routed to (made by route()),
        # set and dropped when that incarnation ends: see _end_run.
        self._runs: dict[str, RunEnded] = {}
        self._ttl: Any = None
        self._closed = False

    # ---- lifecycle of the orchestrator -------------------------------------------------

    async def start(self, *, ttl_interval_s: float = 1.0, recover: bool = True) -> None:
        """Recover the store against reality (recovery.py), then start the TTL loop."""
        from .recovery import recover as run_recovery
        from .ttl import TtlLoop

        if recover:
            await run_recovery(self.store, self.runtime, self.envd, clock=self.clock)
        self._ttl = TtlLoop(self, interval_s=ttl_interval_s)
        self._ttl.start()

    async def aclose(self, *, grace_s: float = 30.0) -> None:
        """Stop the TTL loop, let in-flight operations finish (up to `grace_s`), cancel the
        rest (recovery settles them at the next start), close the envd client."""
        if self._closed:
            return
        self._closed = True
        if self._ttl is not None:
            await self._ttl.aclose()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
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

    async def _shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an operation as an owned task; the caller's cancellation does not stop it."""
        return await asyncio.shield(self.spawn(coro))

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        lock = self._locks.get(sandbox_id)
        if lock is None:
            lock = self._locks[sandbox_id] = asyncio.Lock()
        return lock

    async def _db(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return await self.store.run(fn, *args, **kwargs)  # type: ignore[no-any-return,no-untyped-call]

    async def _record(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox's record; SandboxNotFound when unknown or killed."""
        rec = await self._db(self.store.get_sandbox, sandbox_id)
        if rec.state in GONE:
            raise SandboxNotFound(sandbox_id)
        return rec

    def _check_timeout(self, timeout_s: int, what: str = "timeout") -> None:
        if timeout_s < 0 or timeout_s > self.max_timeout_s:
            raise InvalidRequest(f"'{what}' must be between 0 and {self.max_timeout_s} seconds, "
                                 f"got {timeout_s}")

    # ---- create ------------------------------------------------------------------------

    async def create(self, req: CreateRequest) -> SandboxInfo:
        self._check_timeout(req.timeout_s)
        if req.idempotency_key:
            return await self._create_idempotent(req, req.idempotency_key)
        return await self._shielded(self._create(req))

    async def _create_idempotent(self, req: CreateRequest, key: str) -> SandboxInfo:
        body = json.dumps({k: v for k, v in dataclasses.asdict(req).items()
                           if k != "idempotency_key"}, sort_keys=True, default=str)
        new, sandbox_id, stored = await self._db(self.store.claim_idempotency_key, key, body)
        if not new:
            if stored != body:
                raise IdempotencyMismatch(key)
            if sandbox_id is not None:
                return sandbox_info(await self._db(self.store.get_sandbox, sandbox_id))
            inflight = self._idempotent.get(key)
            if inflight is not None:
                return await asyncio.shield(inflight)
            # else: a claim left by a service that died mid-create; create now.
        task = self.spawn(self._create_bound(req, key))
        self._idempotent[key] = task
        task.add_done_callback(lambda _: self._idempotent.pop(key, None))
        return await asyncio.shield(task)

    async def _create_bound(self, req: CreateRequest, key: str) -> SandboxInfo:
        try:
            info = await self._create(req)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._db(self.store.bind_idempotency_key, key, None)
            raise
        await self._db(self.store.bind_idempotency_key, key, info.sandbox_id)
        return info

    async def _create(self, req: CreateRequest) -> SandboxInfo:
        source = await self._resolve_template(req.template_id)
        is_default = source.id == self.default_template
        return await self._new_sandbox(
            source, template_id=source.id, alias=self.default_template if is_default else None,
            timeout_s=req.timeout_s, auto_pause=req.auto_pause, auto_resume=req.auto_resume,
            metadata=req.metadata, env_vars=req.env_vars, network=req.network,
            secure=req.secure, parent_id=None, op="created",
            auto_pause_memory=req.auto_pause_memory)

    async def _resolve_template(self, template_id: str) -> SnapshotRecord:
        """The snapshot to start from: the default template (built on first use, once even
        when many creates race), or a template / named snapshot by id."""
        tid = self.default_template if template_id in self._aliases else template_id
        for candidate in (tid, f"{tid}:default"):
            with contextlib.suppress(SnapshotNotFound):
                snap = await self._db(self.store.get_snapshot, candidate)
                if snap.kind in ("template", "named"):
                    return snap
        if tid != self.default_template:
            raise SnapshotNotFound(template_id)
        lock = self._template_locks.setdefault(tid, asyncio.Lock())
        async with lock:
            with contextlib.suppress(SnapshotNotFound):
                return await self._db(self.store.get_snapshot, tid)
            log.info("building template %r (first use)", tid)
            try:
                ref = await self.runtime.build_template(tid, self.machine)
            except Exception as exc:
                raise OperationFailed(f"building template '{tid}' failed: {exc}") from exc
            snap = SnapshotRecord(id=tid, kind="template", created_at=ref.created_at,
                                  parent_id=ref.parent_id,
                                  spec={"ref": ref_to_json(ref), "envd_token": None})
            return await self._db(self.store.insert_snapshot, snap)

    async def _new_sandbox(self, source: SnapshotRecord, *, template_id: str, alias: str | None,
                           timeout_s: int, auto_pause: bool, auto_resume: bool,
                           metadata: dict[str, str], env_vars: dict[str, str],
                           network: NetworkConfig, secure: bool, parent_id: str | None,
                           op: str, auto_pause_memory: bool = True) -> SandboxInfo:
        """Persist `creating`, start from `source`, /init envd, then `running` (or killed)."""
        ref = snapshot_ref(source)
        held_token = source.spec.get("envd_token")
        sandbox_id = ids.new_sandbox_id()
        # A snapshot taken after an /init keeps that token inside envd: the new sandbox
        # must get its own token then, or it would answer to the source's.
        token = ids.new_envd_token() if (secure or held_token) else None
        now = self.clock()
        rec = SandboxRecord(
            id=sandbox_id, template_id=template_id, alias=alias, state=S.CREATING,
            cpu_count=ref.machine.cpu_count, memory_mb=ref.machine.memory_mb,
            disk_mb=ref.machine.disk_mb, started_at=now, end_at=now + timeout_s,
            auto_pause=auto_pause, auto_resume=auto_resume, metadata=dict(metadata),
            env_vars=dict(env_vars), envd_token=token,
            traffic_token=None if network.allow_public_traffic else ids.new_traffic_token(),
            network=network_to_json(network),
            runtime={"origin": source.id, **({} if auto_pause_memory else
                                             {"auto_pause_memory": False})},
            parent_id=parent_id)
        async with self._lock(sandbox_id):
            await self._db(self.store.insert_sandbox, rec,
                           event={"op": "create", "source": source.id})
            try:
                placement = await self.runtime.start(sandbox_id, ref, network)
            except Exception as exc:
                await self._db(self.store.transition, sandbox_id, {S.CREATING}, S.KILLED,
                               event={"op": "create_failed", "error": str(exc)})
                raise OperationFailed(f"starting sandbox {sandbox_id} failed: {exc}") from exc
            try:
                await self.envd.init(placement, token=token, current_token=held_token,
                                     env_vars=rec.env_vars)
                now = self.clock()
                rec = await self._db(
                    self.store.transition, sandbox_id, {S.CREATING}, S.RUNNING,
                    event={"op": op}, started_at=now, end_at=now + timeout_s,
                    runtime=with_runtime(rec, placement=placement_to_json(placement)))
            except Exception as exc:
                await self._release(sandbox_id)
                await self._db(self.store.transition, sandbox_id, {S.CREATING}, S.KILLED,
                               event={"op": "create_failed", "error": str(exc)})
                if isinstance(exc, OrchestratorError):
                    raise
                raise OperationFailed(f"initializing sandbox {sandbox_id} failed: {exc}") from exc
        return sandbox_info(rec, now=self.clock())

    async def _release(self, sandbox_id: str) -> None:
        """runtime.kill, logged instead of raised (used on paths already failing)."""
        try:
            await self.runtime.kill(sandbox_id)
        except Exception:
            log.exception("releasing sandbox %s failed", sandbox_id)

    # ---- read --------------------------------------------------------------------------

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return sandbox_info(await self._record(sandbox_id), now=self.clock())

    async def list(self, flt: ListFilter) -> Sequence[SandboxInfo]:
        recs = await self._db(self.store.list_sandboxes, expand_states(flt.states))
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

    # ---- kill --------------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        await self._shielded(self._kill(sandbox_id))

    async def _kill(self, sandbox_id: str, op: str = "killed") -> None:
        async with self._lock(sandbox_id):
            await self._kill_locked(await self._record(sandbox_id), op)
        self._locks.pop(sandbox_id, None)
        try:
            await self.collect_snapshots()
        except Exception:
            log.exception("snapshot garbage collection failed")

    async def _kill_locked(self, rec: SandboxRecord, op: str) -> None:
        movable = {s for s in S if s not in GONE}
        await self._db(self.store.transition, rec.id, movable, S.KILLING, event={"op": op})
        self._end_run(rec.id, "killed" if op != "timeout" else "killed (its timeout ran out)")
        try:
            await self.runtime.kill(rec.id)
        except Exception as exc:
            # Stays `killing` (invisible); recovery retries the kill at the next start.
            raise OperationFailed(f"killing sandbox {rec.id} failed: {exc}") from exc
        await self._db(self.store.transition, rec.id, {S.KILLING}, S.KILLED,
                       end_at=self.clock(), runtime=with_runtime(rec, placement=None))

    async def collect_snapshots(self) -> builtins.list[str]:
        """Delete pause/fork snapshots nobody can reach any more: their sandbox is gone, no
        live sandbox started from or resumes from them, no other snapshot builds on them."""
        deleted: list[str] = []
        while True:
            recs = await self._db(self.store.list_sandboxes)
            snaps = await self._db(self.store.list_snapshots)
            alive = {r.id for r in recs if r.state not in GONE}
            used = {r.snapshot_id for r in recs if r.state not in GONE}
            used |= {r.runtime.get("origin") for r in recs if r.state not in GONE}
            parents = {s.parent_id for s in snaps} | {
                snapshot_ref(s).parent_id for s in snaps if "ref" in s.spec}
            victims = [s for s in snaps if s.kind in ("pause", "fork")
                       and s.sandbox_id not in alive and s.id not in used
                       and s.id not in parents and snapshot_ref(s).snapshot_id not in parents]
            if not victims:
                return deleted
            for snap in victims:
                with contextlib.suppress(KeyError, LookupError):
                    await self.runtime.delete_snapshot(snapshot_ref(snap).snapshot_id)
                await self._db(self.store.delete_snapshot, snap.id)
                deleted.append(snap.id)

    # ---- TTL ---------------------------------------------------------------------------

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        self._check_timeout(timeout_s)
        async with self._lock(sandbox_id):
            rec = await self._record(sandbox_id)
            if rec.end_at is None:  # paused: the TTL it gets when resumed
                await self._db(self.store.update_fields, sandbox_id, ttl_left_s=float(timeout_s))
            else:
                await self._db(self.store.update_fields, sandbox_id,
                               end_at=self.clock() + timeout_s)

    async def extend_timeout(self, sandbox_id: str, duration_s: int) -> None:
        """Keep alive for at least `duration_s` more seconds (never shortens)."""
        self._check_timeout(duration_s, "duration")
        async with self._lock(sandbox_id):
            rec = await self._record(sandbox_id)
            if rec.end_at is None:
                left = max(rec.ttl_left_s or 0.0, float(duration_s))
                await self._db(self.store.update_fields, sandbox_id, ttl_left_s=left)
            else:
                end = max(rec.end_at, self.clock() + duration_s)
                await self._db(self.store.update_fields, sandbox_id, end_at=end)

    async def vm_exited(self, sandbox_id: str) -> str | None:
        """The watchdog's handler for a running sandbox whose VM ended by itself: end its
        proxied streams, release what the VM held, and settle it to paused (on its last
        snapshot) or killed. Returns the new state, or None when nothing was to be done."""
        from .recovery import settle_exited

        async with self._lock(sandbox_id):
            try:
                rec = await self._record(sandbox_id)
            except SandboxNotFound:
                return None
            if rec.state is not S.RUNNING or sandbox_id not in self.runtime.exited():
                return None  # an operation got there first
            log.warning("sandbox %s: its VM exited on its own", sandbox_id)
            self._end_run(sandbox_id, "stopped (its VM exited)")
            state = await settle_exited(self.store, self.runtime, self.envd, rec,
                                        clock=self.clock)
        return state.value

    async def expired(self) -> builtins.list[str]:
        """Running sandboxes whose TTL has run out."""
        now = self.clock()
        recs = await self._db(self.store.list_sandboxes, {S.RUNNING})
        return [r.id for r in recs if r.end_at is not None and r.end_at <= now]

    async def expire(self, sandbox_id: str) -> str | None:
        """Pause (autoPause) or kill a sandbox whose TTL ran out; re-checked under its lock
        (the TTL may have been extended meanwhile). Returns "paused", "killed" or None."""
        async with self._lock(sandbox_id):
            try:
                rec = await self._record(sandbox_id)
            except SandboxNotFound:
                return None
            if rec.state is not S.RUNNING or rec.end_at is None or rec.end_at > self.clock():
                return None
            if rec.auto_pause:
                memory = rec.runtime.get("auto_pause_memory", True)
                if not memory:
                    try:
                        await self._check_guest(rec, sync=True)
                    except GuestUnresponsive as exc:  # keep everything rather than lose data
                        log.warning("%s; pausing it with its memory instead", exc)
                        memory = True
                await self._pause_locked(rec, op="timeout", memory=memory)
                return "paused"
            await self._kill_locked(rec, op="timeout")
        self._locks.pop(sandbox_id, None)
        with contextlib.suppress(Exception):
            await self.collect_snapshots()
        return "killed"

    # ---- pause / resume ----------------------------------------------------------------

    async def pause(self, sandbox_id: str, *, memory: bool = True,
                    require_healthy: bool = False) -> None:
        """Pause: memory + disk (resume continues every process), or `memory=False`: the
        disk alone (a filesystem-only pause; resume cold-boots it). A filesystem-only pause,
        and one with `require_healthy`, needs envd to answer (GuestUnresponsive, nothing
        changed, if it does not)."""
        await self._shielded(self._pause(sandbox_id, memory, require_healthy))

    async def _pause(self, sandbox_id: str, memory: bool, require_healthy: bool) -> None:
        async with self._lock(sandbox_id):
            rec = await self._record(sandbox_id)
            if rec.state is S.RUNNING and (require_healthy or not memory):
                await self._check_guest(rec, sync=not memory)
            await self._pause_locked(rec, op="paused", memory=memory)

    async def _check_guest(self, rec: SandboxRecord, *, sync: bool) -> None:
        """envd answers (and, with `sync`, has flushed the guest's page cache to disk: a
        filesystem-only pause keeps nothing else)."""
        placement = placement_of(rec)
        if placement is None:
            raise GuestUnresponsive(f"sandbox '{rec.id}' has no running VM to ask")
        try:
            if sync:
                await self.envd.sync(placement, rec.envd_token)
                return
        except OperationFailed as exc:
            raise GuestUnresponsive(f"sandbox '{rec.id}': envd did not sync the guest's "
                                    f"filesystems ({exc}); the sandbox keeps running") from exc
        if not await self.envd.healthy(placement):
            raise GuestUnresponsive(f"sandbox '{rec.id}': envd does not answer; the sandbox "
                                    "keeps running")

    async def _pause_locked(self, rec: SandboxRecord, op: str, *, memory: bool = True) -> None:
        sid = rec.id
        snap_id = ids.new_runtime_snapshot_id("pause")
        pending = {"store_id": snap_id, "runtime_id": snap_id, "kind": "pause"}
        rec = await self._db(self.store.transition, sid, {S.RUNNING}, S.PAUSING,
                             runtime=with_runtime(rec, pending=pending))
        # Streams into the VM end now, before it stops (if the pause fails they stay ended).
        self._end_run(sid, "paused" if op != "timeout" else "paused (its timeout ran out)")
        try:
            ref = await self.runtime.snapshot(sid, snap_id, stop=True, memory=memory)
        except Exception as exc:
            await self._db(self.store.transition, sid, {S.PAUSING}, S.RUNNING,
                           event={"op": "pause_failed", "error": str(exc)},
                           runtime=with_runtime(rec, pending=None))
            raise OperationFailed(f"pausing sandbox {sid} failed: {exc}") from exc
        now = self.clock()
        ttl_left = 0.0 if op == "timeout" or rec.end_at is None else max(0.0, rec.end_at - now)
        await self._db(self.store.insert_snapshot, self._snapshot_record(
            snap_id, "pause", ref, rec))
        await self._db(self.store.transition, sid, {S.PAUSING}, S.PAUSED,
                       event={"op": op, **({} if memory else {"mode": "filesystem"})},
                       snapshot_id=snap_id, end_at=None, ttl_left_s=ttl_left,
                       runtime=with_runtime(rec, pending=None, placement=None,
                                            pause_mode="full" if memory else "filesystem"))

    @staticmethod
    def _snapshot_record(store_id: str, kind: str, ref: SnapshotRef, rec: SandboxRecord,
                         name: str | None = None) -> SnapshotRecord:
        return SnapshotRecord(id=store_id, kind=kind, created_at=ref.created_at,
                              sandbox_id=rec.id, name=name, parent_id=ref.parent_id,
                              spec={"ref": ref_to_json(ref), "envd_token": rec.envd_token,
                                    "template_id": rec.template_id})

    async def connect(self, sandbox_id: str, timeout_s: int | None, *,
                      memory: bool = True) -> tuple[SandboxInfo, bool]:
        """Resume a paused sandbox (or extend a running one's TTL). `memory=False` resumes
        by a reboot of its disk (E2B `on_resume="reboot"`); a filesystem-only pause always
        resumes that way."""
        if timeout_s is not None:
            self._check_timeout(timeout_s)
        return await self._shielded(self._connect(sandbox_id, timeout_s, memory))

    async def _connect(self, sandbox_id: str, timeout_s: int | None,
                       memory: bool = True) -> tuple[SandboxInfo, bool]:
        async with self._lock(sandbox_id):
            rec = await self._record(sandbox_id)
            if rec.state is S.RUNNING:
                if timeout_s is not None and rec.end_at is not None:
                    end = self.clock() + timeout_s
                    if end > rec.end_at:  # a running sandbox's TTL only grows
                        rec = await self._db(self.store.update_fields, sandbox_id, end_at=end)
                return sandbox_info(rec, now=self.clock()), False
            if rec.state is not S.PAUSED:
                raise StateConflict(sandbox_id, rec.state, {S.RUNNING, S.PAUSED})
            rec = await self._resume_locked(rec, timeout_s, reboot=not memory)
            return sandbox_info(rec, now=self.clock()), True

    async def _resume_locked(self, rec: SandboxRecord, timeout_s: int | None, *,
                             reboot: bool = False) -> SandboxRecord:
        sid = rec.id
        if rec.snapshot_id is None:
            raise OperationFailed(f"paused sandbox {sid} has no snapshot to resume from")
        snap = await self._db(self.store.get_snapshot, rec.snapshot_id)
        rec = await self._db(self.store.transition, sid, {S.PAUSED}, S.RESUMING)
        ref = snapshot_ref(snap)
        # a cold boot (reboot, or a filesystem-only snapshot) starts an envd with no token
        reboot = reboot or (ref.facts or {}).get("memory", True) is None
        try:
            placement = await self.runtime.start(sid, ref, network_from_json(rec.network),
                                                 reboot=reboot)
        except Exception as exc:
            await self._db(self.store.transition, sid, {S.RESUMING}, S.PAUSED,
                           event={"op": "resume_failed", "error": str(exc)})
            raise OperationFailed(f"resuming sandbox {sid} failed: {exc}") from exc
        try:
            # Same token as before the pause: SDK handles of this sandbox keep working.
            await self.envd.init(placement, token=rec.envd_token,
                                 current_token=None if reboot else snap.spec.get("envd_token"),
                                 env_vars=rec.env_vars)
        except Exception as exc:
            await self._release(sid)
            await self._db(self.store.transition, sid, {S.RESUMING}, S.PAUSED,
                           event={"op": "resume_failed", "error": str(exc)})
            if isinstance(exc, OrchestratorError):
                raise
            raise OperationFailed(f"initializing resumed sandbox {sid} failed: {exc}") from exc
        if timeout_s is None:
            timeout_s = int(rec.ttl_left_s) if rec.ttl_left_s else self.default_timeout_s
        return await self._db(self.store.transition, sid, {S.RESUMING}, S.RUNNING,
                              event={"op": "resumed", **({"reboot": True} if reboot else {})},
                              end_at=self.clock() + timeout_s, ttl_left_s=None,
                              runtime=with_runtime(rec, placement=placement_to_json(placement),
                                                   pause_mode=None))

    # ---- snapshots ---------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str | None) -> SnapshotInfo:
        try:
            public_id = ids.public_snapshot_id(name, sandbox_id)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return await self._shielded(self._snapshot(sandbox_id, public_id, name))

    async def _snapshot(self, sandbox_id: str, public_id: str, name: str | None) -> SnapshotInfo:
        async with self._lock(sandbox_id):
            rec = await self._record(sandbox_id)
            ref = await self._live_snapshot(rec, S.SNAPSHOTTING, public_id, "named")
            snap = await self._db(self.store.insert_snapshot, self._snapshot_record(
                public_id, "named", ref, rec, name=name))
            await self._db(self.store.transition, sandbox_id, {S.SNAPSHOTTING}, S.RUNNING,
                           event={"op": "snapshot", "snapshot_id": public_id},
                           runtime=with_runtime(rec, pending=None))
        return snapshot_info(snap)

    async def _live_snapshot(self, rec: SandboxRecord, via: S, store_id: str | None,
                             kind: str) -> SnapshotRef:
        """running -> `via`, snapshot without stopping; back to running on failure.
        `store_id` None: the store keeps the snapshot under the runtime's id."""
        runtime_id = ids.new_runtime_snapshot_id(kind)
        pending = {"store_id": store_id or runtime_id, "runtime_id": runtime_id, "kind": kind}
        rec = await self._db(self.store.transition, rec.id, {S.RUNNING}, via,
                             runtime=with_runtime(rec, pending=pending))
        try:
            return await self.runtime.snapshot(rec.id, runtime_id, stop=False)
        except Exception as exc:
            await self._db(self.store.transition, rec.id, {via}, S.RUNNING,
                           event={"op": f"{kind}_failed", "error": str(exc)},
                           runtime=with_runtime(rec, pending=None))
            raise OperationFailed(f"snapshotting sandbox {rec.id} failed: {exc}") from exc

    async def list_snapshots(self, sandbox_id: str | None,
                             name: str | None) -> Sequence[SnapshotInfo]:
        snaps = await self._db(self.store.list_snapshots, sandbox_id=sandbox_id, kinds=["named"])
        if name:
            snaps = [s for s in snaps
                     if name in (s.id, s.name) or s.id.startswith(f"{name}:")]
        return [snapshot_info(s) for s in snaps]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        snap = await self._db(self.store.get_snapshot, snapshot_id)
        if snap.kind != "named":
            raise SnapshotNotFound(snapshot_id)
        with contextlib.suppress(KeyError, LookupError):
            await self.runtime.delete_snapshot(snapshot_ref(snap).snapshot_id)
        await self._db(self.store.delete_snapshot, snapshot_id)

    # ---- fork --------------------------------------------------------------------------

    async def fork(self, sandbox_id: str, count: int, timeout_s: int | None) -> Sequence[ForkResult]:
        if not 1 <= count <= MAX_FORK:
            raise InvalidRequest(f"'count' must be between 1 and {MAX_FORK}, got {count}")
        if timeout_s is not None:
            self._check_timeout(timeout_s)
        return await self._shielded(self._fork(sandbox_id, count, timeout_s))

    async def _fork(self, sandbox_id: str, count: int,
                    timeout_s: int | None) -> builtins.list[ForkResult]:
        async with self._lock(sandbox_id):
            rec = await self._record(sandbox_id)
            ref = await self._live_snapshot(rec, S.FORKING, None, "fork")
            snap = await self._db(self.store.insert_snapshot, self._snapshot_record(
                ref.snapshot_id, "fork", ref, rec))
            await self._db(self.store.transition, sandbox_id, {S.FORKING}, S.RUNNING,
                           event={"op": "forked", "snapshot_id": snap.id, "count": count},
                           runtime=with_runtime(rec, pending=None))
        results: list[ForkResult] = [ForkResult() for _ in range(count)]

        async def child(i: int) -> None:
            try:
                info = await self._new_sandbox(
                    snap, template_id=rec.template_id, alias=rec.alias,
                    timeout_s=self.default_timeout_s if timeout_s is None else timeout_s,
                    auto_pause=rec.auto_pause, auto_resume=rec.auto_resume,
                    metadata=rec.metadata, env_vars=rec.env_vars,
                    network=network_from_json(rec.network), secure=True,
                    parent_id=sandbox_id, op="created_by_fork",
                    auto_pause_memory=rec.runtime.get("auto_pause_memory", True))
                results[i] = ForkResult(sandbox=info)
            except Exception as exc:  # noqa: BLE001 - each child succeeds or fails on its own
                status = exc.status if isinstance(exc, OrchestratorError) else 500
                results[i] = ForkResult(error=str(exc), error_status=status)

        async with asyncio.TaskGroup() as tg:
            for i in range(count):
                tg.create_task(child(i))
        return results

    # ---- observability, network, routing -----------------------------------------------

    async def metrics(self, sandbox_id: str) -> Sequence[Metric]:
        rec = await self._record(sandbox_id)
        placement = placement_of(rec)
        if rec.state not in LIVE or placement is None:
            return []
        return [await self.envd.metrics(placement, rec.envd_token)]

    async def logs(self, sandbox_id: str, start_ms: int | None, limit: int) -> Sequence[LogLine]:
        rec = await self._db(self.store.get_sandbox, sandbox_id)
        lines = []
        for ev in await self._db(self.store.events, sandbox_id, limit=100_000):
            detail = dict(ev.detail)
            op = detail.pop("op", ev.kind)
            text = f"sandbox {op}" + "".join(f" {k}={v}" for k, v in sorted(detail.items()))
            level = "error" if "error" in detail else "info"
            lines.append(LogLine(timestamp=ev.ts, line=text, level=level))
        if rec.state in LIVE:
            now = self.clock()
            with contextlib.suppress(Exception):
                lines += [LogLine(timestamp=now, line=ln, level="debug")
                          for ln in await self.runtime.console_log(sandbox_id)]
        if start_ms is not None:
            lines = [ln for ln in lines if ln.timestamp * 1000 >= start_ms]
        return lines[:limit]

    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None:
        async with self._lock(sandbox_id):
            rec = await self._record(sandbox_id)
            if rec.state in LIVE:
                try:
                    await self.runtime.update_network(sandbox_id, network)
                except Exception as exc:
                    raise OperationFailed(f"updating the network of {sandbox_id} failed: "
                                          f"{exc}") from exc
            # A paused sandbox gets it at resume (runtime.start takes the network).
            await self._db(self.store.update_fields, sandbox_id,
                           network=network_to_json(network))

    async def route(self, sandbox_id: str, port: int, *, resume: bool) -> Route:
        rec = await self._record(sandbox_id)
        if rec.state not in LIVE and resume and rec.auto_resume and rec.state in (
                S.PAUSED, S.PAUSING, S.RESUMING):
            await self.connect(sandbox_id, None)
            rec = await self._record(sandbox_id)
        placement = placement_of(rec)
        if rec.state not in LIVE or placement is None:
            raise StateConflict(sandbox_id, rec.state, LIVE)
        try:
            host, target = placement.address(port)
        except KeyError:
            raise OperationFailed(f"port {port} of sandbox {sandbox_id} is not forwarded "
                                  "(user-mode networking forwards envd only)") from None
        run = self._runs.get(sandbox_id)
        if run is None:
            run = self._runs[sandbox_id] = RunEnded()
        return Route(host=host, port=target, traffic_token=rec.traffic_token, gone=run)

    def _end_run(self, sandbox_id: str, reason: str) -> None:
        """The running incarnation of `sandbox_id` ends (`reason`: "paused", "killed", ...):
        tell the proxy, whose open exchanges into it would otherwise hang on a VM that is
        gone. Called right after the store left `running`, before the VM is stopped: a
        route() that read `running` before that has its event by then (the store runs its
        calls in order on one thread), and one that reads after it cannot route here, so
        the next incarnation (a resume) gets a fresh event."""
        run = self._runs.pop(sandbox_id, None)
        if run is not None:
            run.end(reason)
