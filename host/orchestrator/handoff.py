"""Handoffs: paused sandboxes another node of the cluster can take over.

A node in a cluster (`NodeOrchestrator(handoff=True)`) writes, after every pause, the
sandbox's record and its pause snapshot's record into the repository
(`runtime.put_document`, named `handoff-<id>`); the snapshot itself is there already. Another node sharing the
repository `adopt`s the sandbox when the cluster sends its resume there (its node is
gone): the records enter that node's store as a paused sandbox, in one transaction, and
`connect` resumes it as any other. The document is withdrawn when the sandbox resumes or
is killed where it is held, so a pause that was resumed since never comes back.

Which node holds a sandbox is the cluster's decision (the gateway's binding); a node whose
paused sandbox was taken over drops its copy with `forget`: its records only, never the
snapshots, which belong to the adopter now.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .errors import OperationFailed, SandboxNotFound
from .model import SandboxInfo
from .opcontext import Context
from .records import sandbox_info
from .states import SandboxState as S
from .store import SandboxRecord, SnapshotRecord

log = logging.getLogger(__name__)

VERSION = 1
# runtime facts that travel (what a resume needs); the rest is about this node's VM
PORTABLE_RUNTIME = ("guest", "pause_mode", "auto_pause_memory", "origin")


def name(sandbox_id: str) -> str:
    """The shared document's name."""
    return f"handoff-{sandbox_id}"


def document(rec: SandboxRecord, snap: SnapshotRecord) -> dict[str, Any]:
    sandbox = dataclasses.asdict(rec)
    sandbox["state"] = rec.state.value
    sandbox["runtime"] = {k: v for k, v in rec.runtime.items() if k in PORTABLE_RUNTIME}
    return {"version": VERSION, "sandbox": sandbox, "snapshot": dataclasses.asdict(snap)}


def records(doc: dict[str, Any]) -> tuple[SandboxRecord, SnapshotRecord]:
    if doc.get("version") != VERSION:
        raise OperationFailed(f"handoff document version {doc.get('version')!r} is not "
                              f"{VERSION}: a node of another release wrote it")
    sandbox = dict(doc["sandbox"])
    sandbox["state"] = S(sandbox["state"])
    return SandboxRecord(**sandbox), SnapshotRecord(**doc["snapshot"])


async def publish(ctx: Context, sandbox_id: str) -> None:
    """After a pause: the paused sandbox's records, for another node. A failure is
    logged, not raised: the pause itself succeeded, and the sandbox still resumes here."""
    if not ctx.handoff:
        return
    try:
        rec = await ctx.db(ctx.store.get_sandbox, sandbox_id)
        if rec.state is not S.PAUSED or rec.snapshot_id is None:
            return
        snap = await ctx.db(ctx.store.get_snapshot, rec.snapshot_id)
        await ctx.runtime.put_document(name(sandbox_id), document(rec, snap))
    except Exception:
        log.exception("sandbox %s: writing its handoff document failed; it can resume "
                      "only on this node", sandbox_id)


async def withdraw(ctx: Context, sandbox_id: str) -> None:
    """On resume or kill: the sandbox is no longer a pause another node may take."""
    if not ctx.handoff:
        return
    try:
        await ctx.runtime.delete_document(name(sandbox_id))
    except Exception:  # left behind, an adopt after this node died would resume that pause
        log.exception("sandbox %s: removing its handoff document failed", sandbox_id)


async def adopt(ctx: Context, sandbox_id: str) -> SandboxInfo:
    """Take over the paused sandbox `sandbox_id` from the repository (its node is gone).
    Idempotent: a sandbox this node holds already is returned as it is. SandboxNotFound
    when no node left a handoff for it; OperationFailed when its snapshot is missing."""
    async with ctx.lock(sandbox_id):
        try:
            rec = await ctx.db(ctx.store.get_sandbox, sandbox_id)
        except SandboxNotFound:
            pass
        else:
            return sandbox_info(rec, now=ctx.clock())
        doc = await ctx.runtime.get_document(name(sandbox_id))
        if doc is None:
            raise SandboxNotFound(sandbox_id)
        rec, snap = records(doc)
        if rec.id != sandbox_id or rec.state is not S.PAUSED or snap.id != rec.snapshot_id:
            raise OperationFailed(f"the handoff document of sandbox {sandbox_id} does not "
                                  "describe it paused")
        if await ctx.runtime.find_snapshot(snap.id) is None:
            raise OperationFailed(f"sandbox {sandbox_id}'s snapshot {snap.id} is not in "
                                  "the repository")
        rec = await ctx.db(ctx.store.insert_sandbox, rec, snapshot=snap,
                           event={"op": "adopted"})
        log.info("sandbox %s: adopted from the repository (paused)", sandbox_id)
        return sandbox_info(rec, now=ctx.clock())


async def forget(ctx: Context, sandbox_id: str) -> bool:
    """Drop this node's records of a paused sandbox another node took over (its
    snapshots stay: they are the adopter's now). False when it is not paused here."""
    async with ctx.lock(sandbox_id):
        try:
            rec = await ctx.db(ctx.store.get_sandbox, sandbox_id)
        except SandboxNotFound:
            return False
        if rec.state is not S.PAUSED:
            return False
        await ctx.db(ctx.store.delete_sandbox, sandbox_id)
        for snap in await ctx.db(ctx.store.list_snapshots, sandbox_id=sandbox_id):
            if snap.kind == "pause":  # named snapshots stay this node's templates
                await ctx.db(ctx.store.delete_snapshot, snap.id)
        log.info("sandbox %s: forgotten here (another node holds it)", sandbox_id)
        return True
