"""Forking a sandbox: create up to `MAX_FORK` children concurrently from one snapshot of
it, each with its own id, tokens and writable layers; each succeeds or fails on its own
(`ForkResult`). A running sandbox is snapshotted live (`forking`, the VM keeps running).
A paused one forks from the snapshot it is paused on, with no VM of its own started: it
stays paused (an RL trainer keeps a checkpoint paused and branches from it); its
children keep that snapshot while they live (snapshots.collect_snapshots). A
filesystem-only pause has no memory to fork from (409: resume it first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from . import lifecycle, mounts
from .errors import Conflict, InvalidRequest, OperationFailed, OrchestratorError
from .model import ForkResult
from .opcontext import Context, observed
from .records import (
    network_from_json,
    snapshot_record,
    snapshot_ref,
    with_runtime,
    without_memory,
)
from .snapshots import live_snapshot
from .states import SandboxState as S
from .store import SandboxRecord, SnapshotRecord

MAX_FORK = 16


async def fork(ctx: Context, sandbox_id: str, count: int,
               timeout_s: int | None) -> Sequence[ForkResult]:
    if not 1 <= count <= MAX_FORK:
        raise InvalidRequest(f"'count' must be between 1 and {MAX_FORK}, got {count}")
    if timeout_s is not None:
        ctx.check_timeout(timeout_s)
    return await ctx.shielded(_fork(ctx, sandbox_id, count, timeout_s))


@observed("fork")
async def _fork(ctx: Context, sandbox_id: str, count: int,
                timeout_s: int | None) -> list[ForkResult]:
    async with ctx.lock(sandbox_id):
        rec = await ctx.record(sandbox_id)
        if rec.state is S.PAUSED:
            snap = await _paused_on(ctx, rec)
            await ctx.db(ctx.store.add_event, sandbox_id, "forked",
                         {"op": "forked", "snapshot_id": snap.id, "count": count,
                          "paused": True})
        else:
            ref = await live_snapshot(ctx, rec, S.FORKING, None, "fork")
            snap = await ctx.db(ctx.store.insert_snapshot, snapshot_record(
                ref.snapshot_id, "fork", ref, rec))
            await ctx.db(ctx.store.transition, sandbox_id, {S.FORKING}, S.RUNNING,
                         event={"op": "forked", "snapshot_id": snap.id, "count": count},
                         runtime=with_runtime(rec, pending=None))
    results: list[ForkResult] = [ForkResult() for _ in range(count)]

    async def child(i: int) -> None:
        try:
            info = await lifecycle.new_sandbox(
                ctx, snap, template_id=rec.template_id, alias=rec.alias,
                timeout_s=ctx.default_timeout_s if timeout_s is None else timeout_s,
                auto_pause=rec.auto_pause, auto_resume=rec.auto_resume,
                metadata=rec.metadata, env_vars=rec.env_vars,
                network=network_from_json(rec.network), secure=True,
                parent_id=sandbox_id, op="created_by_fork",
                auto_pause_memory=rec.runtime.get("auto_pause_memory", True),
                volume_mounts=mounts.of(rec), fanout=count)
            results[i] = ForkResult(sandbox=info)
        except Exception as exc:  # noqa: BLE001 - each child succeeds or fails on its own
            ctx.metrics.operation_failed("fork", exc)  # the fork itself succeeded
            status = exc.status if isinstance(exc, OrchestratorError) else 500
            results[i] = ForkResult(error=str(exc), error_status=status)

    async with asyncio.TaskGroup() as tg:
        for i in range(count):
            tg.create_task(child(i))
    return results


async def _paused_on(ctx: Context, rec: SandboxRecord) -> SnapshotRecord:
    """The snapshot a paused sandbox resumes from, if it has the memory to fork from."""
    if rec.snapshot_id is None:
        raise OperationFailed(f"paused sandbox {rec.id} has no snapshot to fork from")
    snap = await ctx.db(ctx.store.get_snapshot, rec.snapshot_id)
    if without_memory(snapshot_ref(snap)):
        raise Conflict(f"sandbox '{rec.id}' was paused without its memory "
                       "(a filesystem-only pause): resume it, then fork")
    return snap
