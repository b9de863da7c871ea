"""Snapshots of running sandboxes: named snapshots (taken live, the VM keeps running), their
listing and deletion, the store records of every snapshot kind, and the garbage collection
of pause/fork snapshots that nothing can reach any more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from host.contract import Reclaim, SnapshotRef

from . import ids
from .errors import AliasConflict, InvalidRequest, OperationFailed, SnapshotNotFound
from .model import SnapshotInfo
from .opcontext import Context, observed
from .records import (
    GONE,
    placement_of,
    snapshot_info,
    snapshot_record,
    snapshot_ref,
    with_runtime,
)
from .states import SandboxState as S
from .store import SandboxRecord
from .templates import catalog
from .templates.names import TEAM


async def snapshot(ctx: Context, sandbox_id: str, name: str | None) -> SnapshotInfo:
    try:
        public_id = ids.public_snapshot_id(name, sandbox_id)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    base = public_id.split(":", 1)[0].lower().removeprefix(f"{TEAM}/")
    if name and await ctx.db(ctx.templates.find_template, base) is not None:
        # creates by this name would start the built template, not the snapshot
        raise AliasConflict(f"'{base}' is already the name of a template")
    return await ctx.shielded(_snapshot(ctx, sandbox_id, public_id, name))


@observed("snapshot")
async def _snapshot(ctx: Context, sandbox_id: str, public_id: str,
                    name: str | None) -> SnapshotInfo:
    async with ctx.lock(sandbox_id):
        rec = await ctx.record(sandbox_id)
        ref = await live_snapshot(ctx, rec, S.SNAPSHOTTING, public_id, "named")
        snap = await ctx.db(ctx.store.insert_snapshot, snapshot_record(
            public_id, "named", ref, rec, name=name))
        await ctx.db(ctx.store.transition, sandbox_id, {S.SNAPSHOTTING}, S.RUNNING,
                     event={"op": "snapshot", "snapshot_id": public_id},
                     runtime=with_runtime(rec, pending=None))
    await catalog.publish_named(ctx, snap)
    return snapshot_info(snap)


def page_cache_reclaim(ctx: Context, rec: SandboxRecord) -> Reclaim | None:
    """The `reclaim` of a memory snapshot of `rec`'s running guest: it drops its clean page
    cache (envd's /aenv/reclaim), which then stays out of the snapshot instead of being
    copied into it and into every sandbox started from it. The runtime calls it when the
    guest's memory makes it worth a call; it answers the MiB freed (0: not done)."""
    placement = placement_of(rec)
    if placement is None:
        return None
    token = rec.envd_token

    async def ask() -> int:
        return await ctx.envd.reclaim(placement, token)

    return ask


async def live_snapshot(ctx: Context, rec: SandboxRecord, via: S, store_id: str | None,
                        kind: str) -> SnapshotRef:
    """running -> `via`, snapshot without stopping; back to running on failure.
    `store_id` None: the store keeps the snapshot under the runtime's id. The caller holds
    the sandbox's lock and moves it back to running once it has stored the snapshot."""
    runtime_id = ids.new_runtime_snapshot_id(kind)
    pending = {"store_id": store_id or runtime_id, "runtime_id": runtime_id, "kind": kind}
    rec = await ctx.db(ctx.store.transition, rec.id, {S.RUNNING}, via,
                       runtime=with_runtime(rec, pending=pending))
    try:
        return await ctx.runtime.snapshot(rec.id, runtime_id, stop=False,
                                          reclaim=page_cache_reclaim(ctx, rec))
    except Exception as exc:
        await ctx.db(ctx.store.transition, rec.id, {via}, S.RUNNING,
                     event={"op": f"{kind}_failed", "error": str(exc)},
                     runtime=with_runtime(rec, pending=None))
        raise OperationFailed(f"snapshotting sandbox {rec.id} failed: {exc}") from exc


async def list_snapshots(ctx: Context, sandbox_id: str | None,
                     name: str | None) -> Sequence[SnapshotInfo]:
    snaps = [s for s in await ctx.db(ctx.store.list_snapshots, sandbox_id=sandbox_id,
                                      kinds=["named"])
             if not catalog.is_foreign(s)]   # listed by their own node
    if name:
        snaps = [s for s in snaps
                 if name in (s.id, s.name) or s.id.startswith(f"{name}:")]
    return [snapshot_info(s) for s in snaps]


async def delete_snapshot(ctx: Context, snapshot_id: str) -> None:
    snap = await ctx.db(ctx.store.get_snapshot, snapshot_id)
    if snap.kind != "named":
        raise SnapshotNotFound(snapshot_id)
    if not catalog.is_foreign(snap):   # another node's: only this node's record goes
        await catalog.withdraw_named(ctx, snap)
        with contextlib.suppress(KeyError, LookupError):
            await ctx.runtime.delete_snapshot(snapshot_ref(snap).snapshot_id)
    await ctx.db(ctx.store.delete_snapshot, snapshot_id)


async def collect_snapshots(ctx: Context, *, dry_run: bool = False) -> list[str]:
    """Delete the snapshots nobody can reach any more:
    - pause and fork snapshots of gone sandboxes, and the earlier pauses of live ones (a
      sandbox resumes from its last pause only; each manifest names every file it needs,
      so a later pause does not need an earlier one's record: chains stay short),
    - template snapshots no tag points at any more (`orphaned`, templates.py),
    unless a live sandbox started from or resumes from them, a running build starts from
    them, or a snapshot other than a pause builds on them (a fork's children, a named
    snapshot, a template: lineage those keep). `dry_run`: only their ids, each round's
    taken as gone (what they kept becomes collectable in the next)."""
    deleted: list[str] = []
    while True:
        recs = await ctx.db(ctx.store.list_sandboxes)
        snaps = [s for s in await ctx.db(ctx.store.list_snapshots) if s.id not in deleted]
        building = await ctx.db(ctx.templates.list_builds, None, ["building"])
        alive = {r.id for r in recs if r.state not in GONE}
        used = {r.snapshot_id for r in recs if r.state not in GONE}
        used |= {r.runtime.get("origin") for r in recs if r.state not in GONE}
        used |= {(r.runtime.get("pending") or {}).get("store_id") for r in recs
                 if r.state not in GONE}
        used |= {b.spec.get("source") for b in building}
        lineage = [s for s in snaps if s.kind != "pause"]
        parents = {s.parent_id for s in lineage} | {
            snapshot_ref(s).parent_id for s in lineage if "ref" in s.spec}
        victims = [s for s in snaps
                   if (s.kind == "pause"
                       or (s.kind == "fork" and s.sandbox_id not in alive)
                       or (s.kind == "template" and s.spec.get("orphaned")))
                   and s.id not in used
                   and s.id not in parents and snapshot_ref(s).snapshot_id not in parents]
        if not victims:
            return deleted
        for snap in victims:
            deleted.append(snap.id)
            if dry_run:
                continue
            if not catalog.is_foreign(snap):   # another node's files stay its own
                with contextlib.suppress(KeyError, LookupError):
                    await ctx.runtime.delete_snapshot(snapshot_ref(snap).snapshot_id)
            await ctx.db(ctx.store.delete_snapshot, snap.id)
