"""Pausing and resuming sandboxes.

Pause moves a running sandbox to `pausing`, ends the proxy's streams into it, snapshots it
with the VM stopped (memory + disk, or the disk alone: a filesystem-only pause), then
`paused` on that snapshot with the TTL left stored. Connect resumes a paused sandbox from
its snapshot (same envd token, so SDK handles keep working) or extends a running one's TTL.

A pause asked through the API is answered once the guest is stopped: from then on nothing
it does can change what the pause keeps, and `pausing` reads as paused. The snapshot is
written after the answer by an owned task that holds the sandbox's lock until it is
committed, so a resume, kill or fork of the sandbox waits for it, and a crash meanwhile
is finished by recovery (`pausing`: the stopped VM is adopted and snapshotted). Like E2B's
deferred rootfs export and asynchronous upload, this takes the writing of what the guest
dirtied off the caller's wait. Two callers wait for the commit instead: the
memory-pressure guard, which pauses to free memory, and every pause of a node in a
cluster, whose answer promises that the sandbox resumes on another node should this one
die (its handoff is in the shared repository once the pause is committed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from host.contract import SnapshotRef

from . import handoff, ids, mounts
from .errors import (
    GuestUnresponsive,
    OperationFailed,
    OrchestratorError,
    StateConflict,
    start_failed,
)
from .model import SandboxInfo
from .opcontext import Context, observed
from .records import (
    DRAINED,
    guest_of,
    network_from_json,
    placement_of,
    placement_to_json,
    sandbox_info,
    snapshot_record,
    snapshot_ref,
    with_runtime,
    without_memory,
)
from .snapshots import page_cache_reclaim
from .states import SandboxState as S
from .store import SandboxRecord

log = logging.getLogger(__name__)

# ---- pause ---------------------------------------------------------------------------

async def pause(ctx: Context, sandbox_id: str, *, memory: bool = True,
                require_healthy: bool = False, early: bool = True, keep: bool = True) -> None:
    """Pause: memory + disk (resume continues every process), or `memory=False`: the
    disk alone (a filesystem-only pause; resume cold-boots it). A filesystem-only pause,
    and one with `require_healthy`, needs envd to answer (GuestUnresponsive, nothing
    changed, if it does not). `early`: return once the guest is stopped, the snapshot
    being committed behind the sandbox's lock (module doc); else once it is committed.
    `keep`: the VM may stay, stopped, for a fast resume (kept.py)."""
    await ctx.shielded(_pause(ctx, sandbox_id, memory, require_healthy, early, keep))


@observed("pause")
async def _pause(ctx: Context, sandbox_id: str, memory: bool, require_healthy: bool,
                 early: bool, keep: bool) -> None:
    early = early and not ctx.handoff  # a cluster's pause answers with its handoff made
    lock = ctx.lock(sandbox_id)
    stopped = asyncio.Event()
    await lock.acquire()
    try:  # the lock goes with the work, which releases it once the pause is committed
        work = ctx.spawn(_pause_holding(ctx, lock, sandbox_id, memory, require_healthy,
                                        stopped.set if early else None, keep))
    except BaseException:
        lock.release()
        raise
    if early:
        ctx.admission.releases(work)
    waiter = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if work.done():
        work.result()  # done before the guest was stopped: its error is the answer


async def _pause_holding(ctx: Context, lock: asyncio.Lock, sandbox_id: str, memory: bool,
                         require_healthy: bool, stopped: Callable[[], None] | None,
                         keep: bool) -> None:
    answer = _Answer(stopped)
    try:
        rec = await ctx.record(sandbox_id)
        if rec.state is S.RUNNING and (require_healthy or not memory):
            await check_guest(ctx, rec, sync=not memory)
        await pause_locked(ctx, rec, op="paused", memory=memory, stopped=answer, keep=keep,
                           reclaim_cache=stopped is None)
    except OrchestratorError as exc:
        if answer.given and stopped is not None:  # the caller has its answer: say it here
            log.warning("sandbox %s: the pause failed after its answer (%s); the sandbox "
                        "runs again", sandbox_id, exc)
        raise
    finally:
        lock.release()


class _Answer:
    """The `stopped` callback of a pause, remembering whether it was called: once it was,
    the caller may have been told "paused"."""

    def __init__(self, stopped: Callable[[], None] | None) -> None:
        self.stopped = stopped
        self.given = False

    def __call__(self) -> None:
        self.given = True
        if self.stopped is not None:
            self.stopped()


async def check_guest(ctx: Context, rec: SandboxRecord, *, sync: bool) -> None:
    """envd answers (and, with `sync`, has flushed the guest's page cache to disk: a
    filesystem-only pause keeps nothing else); GuestUnresponsive if not."""
    placement = placement_of(rec)
    if placement is None:
        raise GuestUnresponsive(f"sandbox '{rec.id}' has no running VM to ask")
    try:
        if sync:
            await ctx.envd.sync(placement, rec.envd_token)
            return
    except OperationFailed as exc:
        raise GuestUnresponsive(f"sandbox '{rec.id}': envd did not sync the guest's "
                                f"filesystems ({exc}); the sandbox keeps running") from exc
    if not await ctx.envd.healthy(placement):
        raise GuestUnresponsive(f"sandbox '{rec.id}': envd does not answer; the sandbox "
                                "keeps running")


@observed("pause")
async def pause_locked(ctx: Context, rec: SandboxRecord, op: str, *,
                       memory: bool = True, stopped: Callable[[], None] | None = None,
                       keep: bool = True, reclaim_cache: bool = True) -> None:
    """Pause `rec`'s running sandbox (op "timeout": its TTL ran out, none is left); the
    caller holds its lock. `stopped` is called once the guest is stopped for good.
    `keep`: the VM may stay, stopped, once the pause is committed (kept.py).
    `reclaim_cache`: the guest first drops its page cache (snapshots.page_cache_reclaim):
    a smaller snapshot and restore, for ~0.2 s (under TCG) more before the guest stops;
    not for a pause whose caller is answered at the stop (measured with it: the answer
    after 200 MiB of writes came after 219 ms, an idle pause's after 11 ms)."""
    sid = rec.id
    keep = keep and memory and ctx.kept is not None and ctx.kept.admits(rec.memory_mb)
    snap_id = ids.new_runtime_snapshot_id("pause")
    pending = {"store_id": snap_id, "runtime_id": snap_id, "kind": "pause",
               "mode": "full" if memory else "filesystem"}
    rec = await ctx.db(ctx.store.transition, sid, {S.RUNNING}, S.PAUSING,
                       runtime=with_runtime(rec, pending=pending))
    # Streams into the VM end now, before it stops (if the pause fails they stay ended).
    ctx.end_run(sid, "paused" if op != "timeout" else "paused (its timeout ran out)")
    answer = _Answer(stopped)
    degraded: dict[str, str] = {}
    try:
        ref = await ctx.runtime.snapshot(sid, snap_id, stop=True, memory=memory,
                                         stopped=answer, keep=keep,
                                         reclaim=(page_cache_reclaim(ctx, rec)
                                                  if memory and reclaim_cache else None))
    except Exception as exc:
        # A pause already answered, or one whose VM died, keeps the disk at least (the
        # caller was told "paused"; a VM-less sandbox must not read as running).
        fallback = memory and (answer.given or sid in ctx.runtime.exited())
        disk = await _disk_only(ctx, rec, sid, exc) if fallback else None
        if disk is None:
            await ctx.db(ctx.store.transition, sid, {S.PAUSING}, S.RUNNING,
                         event={"op": "pause_failed", "error": str(exc)},
                         runtime=with_runtime(rec, pending=None))
            raise OperationFailed(f"pausing sandbox {sid} failed: {exc}") from exc
        ref, snap_id, memory, keep = disk, disk.snapshot_id, False, False
        degraded = {"degraded": f"its memory could not be kept ({exc}); its disk was"}
    now = ctx.clock()
    ttl_left = 0.0 if op == "timeout" or rec.end_at is None else max(0.0, rec.end_at - now)
    await ctx.db(ctx.store.insert_snapshot, snapshot_record(snap_id, "pause", ref, rec))
    await ctx.db(ctx.store.transition, sid, {S.PAUSING}, S.PAUSED,
                 event={"op": op, **({} if memory else {"mode": "filesystem"}), **degraded},
                 snapshot_id=snap_id, end_at=None, ttl_left_s=ttl_left,
                 runtime=with_runtime(rec, pending=None, placement=None,
                                      pause_mode="full" if memory else "filesystem"))
    if keep and ctx.kept is not None:
        ctx.kept.kept(sid)
    await handoff.publish(ctx, sid)


async def _disk_only(ctx: Context, rec: SandboxRecord, sid: str,
                     exc: Exception) -> SnapshotRef | None:
    """The disk-only snapshot of a pause whose memory snapshot failed (`exc`); None when
    that fails too (the runtime no longer has the sandbox, or its disk cannot be sealed)."""
    snap_id = ids.new_runtime_snapshot_id("pause")
    pending = {"store_id": snap_id, "runtime_id": snap_id, "kind": "pause",
               "mode": "filesystem"}
    await ctx.db(ctx.store.update_fields, sid, runtime=with_runtime(rec, pending=pending))
    try:
        ref = await ctx.runtime.snapshot(sid, snap_id, stop=True, memory=False)
    except Exception as again:  # noqa: BLE001 - the first error is the one reported
        log.warning("sandbox %s: its memory snapshot failed (%s), and so did keeping its "
                    "disk (%s)", sid, exc, again)
        return None
    log.warning("sandbox %s: its memory snapshot failed (%s); paused with its disk only "
                "(a resume boots it)", sid, exc)
    return ref


# ---- resume --------------------------------------------------------------------------

async def connect(ctx: Context, sandbox_id: str, timeout_s: int | None, *,
                  memory: bool = True) -> tuple[SandboxInfo, bool]:
    """Resume a paused sandbox (or extend a running one's TTL). `memory=False` resumes
    by a reboot of its disk (E2B `on_resume="reboot"`); a filesystem-only pause always
    resumes that way."""
    if timeout_s is not None:
        ctx.check_timeout(timeout_s)
    return await ctx.shielded(_connect(ctx, sandbox_id, timeout_s, memory))


async def _connect(ctx: Context, sandbox_id: str, timeout_s: int | None,
                   memory: bool = True) -> tuple[SandboxInfo, bool]:
    async with ctx.lock(sandbox_id):
        rec = await ctx.record(sandbox_id)
        if rec.state is S.RUNNING:
            if timeout_s is not None and rec.end_at is not None:
                end = ctx.clock() + timeout_s
                if end > rec.end_at:  # a running sandbox's TTL only grows
                    rec = await ctx.db(ctx.store.update_fields, sandbox_id, end_at=end)
            return sandbox_info(rec, now=ctx.clock()), False
        if rec.state is not S.PAUSED:
            raise StateConflict(sandbox_id, rec.state, {S.RUNNING, S.PAUSED})
        rec = await _resume_locked(ctx, rec, timeout_s, reboot=not memory)
        return sandbox_info(rec, now=ctx.clock()), True


@observed("resume")
async def _resume_locked(ctx: Context, rec: SandboxRecord, timeout_s: int | None, *,
                         reboot: bool = False) -> SandboxRecord:
    sid = rec.id
    if rec.snapshot_id is None:
        raise OperationFailed(f"paused sandbox {sid} has no snapshot to resume from")
    snap = await ctx.db(ctx.store.get_snapshot, rec.snapshot_id)
    rec = await ctx.db(ctx.store.transition, sid, {S.PAUSED}, S.RESUMING)
    ref = snapshot_ref(snap)
    # a cold boot (reboot, or a filesystem-only snapshot) starts an envd with no token
    reboot = reboot or without_memory(ref)
    # A VM kept since the pause (kept.py): runtime.start continues it, unless rebooting
    if ctx.kept is not None and ctx.kept.take(sid) and reboot:
        await ctx.release(sid)
    try:
        async with ctx.admission.start(sid, rec.memory_mb, ctx.vm_holders):
            placement = await ctx.runtime.start(sid, ref, network_from_json(rec.network),
                                                reboot=reboot)
    except Exception as exc:
        await ctx.db(ctx.store.transition, sid, {S.RESUMING}, S.PAUSED,
                     event={"op": "resume_failed", "error": str(exc)})
        raise start_failed(f"resuming sandbox {sid} failed: {exc}", exc) from exc
    try:
        # Same token as before the pause: SDK handles of this sandbox keep working.
        await ctx.envd.init(placement, token=rec.envd_token,
                            current_token=None if reboot else snap.spec.get("envd_token"),
                            env_vars=rec.env_vars, guest=guest_of(rec),
                            volume_mounts=await mounts.attach(ctx, sid, mounts.of(rec)))
    except Exception as exc:
        await ctx.release(sid)
        await mounts.detach(ctx, sid)
        await ctx.db(ctx.store.transition, sid, {S.RESUMING}, S.PAUSED,
                     event={"op": "resume_failed", "error": str(exc)})
        if isinstance(exc, OrchestratorError):
            raise
        raise OperationFailed(f"initializing resumed sandbox {sid} failed: {exc}") from exc
    if timeout_s is None:
        timeout_s = int(rec.ttl_left_s) if rec.ttl_left_s else ctx.default_timeout_s
    rec = await ctx.db(ctx.store.transition, sid, {S.RESUMING}, S.RUNNING,
                       event={"op": "resumed", **({"reboot": True} if reboot else {})},
                       end_at=ctx.clock() + timeout_s, ttl_left_s=None,
                       runtime=with_runtime(rec, placement=placement_to_json(placement),
                                            pause_mode=None, **{DRAINED: None}))
    await handoff.withdraw(ctx, sid)  # running now: that pause may not be taken over
    return rec
