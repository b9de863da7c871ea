"""Recovery at start: make the store agree with reality after the host service stopped.

For every sandbox the store knows (states.py draws the machine):

    running       adopt -> running | else paused (own pause snapshot) | else killed
    creating      kill -> killed (the client never got it)
    pausing       new snapshot committed (store, else runtime.find_snapshot) -> paused on it
                  | else adopt -> running (envd answers) or paused on a fresh snapshot
                    (vCPUs left stopped) | else paused on the previous snapshot | killed
    resuming      adopt + /init again (same token) -> running | else kill -> paused
    snapshotting,
    forking       adopt -> running (envd answers) or paused on a fresh snapshot
                  | else paused (own pause snapshot) | else killed
    killing       kill -> killed

Then `runtime.reap_orphans(ids that should have a live VM)`. Snapshot ids are chosen by
the orchestrator and persisted (`runtime["pending"]`) in the transition *before* the
runtime writes them, so a crash mid-pause leaves a name to look up, never a guess.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from host.contract import Placement, SandboxRuntime, SnapshotRef

from . import ids
from .envd import EnvdClient
from .errors import SnapshotNotFound
from .records import (
    guest_of,
    placement_of,
    placement_to_json,
    ref_to_json,
    snapshot_record,
    with_runtime,
)
from .states import SandboxState as S
from .store import SandboxRecord, SnapshotRecord, Store

log = logging.getLogger(__name__)


class _Recovery:
    def __init__(self, store: Store, runtime: SandboxRuntime, envd: EnvdClient,
                 clock: Callable[[], float], op: str = "recovered") -> None:
        self.store = store
        self.runtime = runtime
        self.envd = envd
        self.clock = clock
        self.op = op  # the event's op

    async def db(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return await self.store.run(fn, *args, **kwargs)  # type: ignore[no-untyped-call]

    async def kill_quietly(self, sid: str) -> None:
        try:
            await self.runtime.kill(sid)
        except Exception:
            log.exception("recovery: releasing %s failed", sid)

    async def adopt(self, rec: SandboxRecord) -> Placement | None:
        p = placement_of(rec)
        facts: dict[str, Any] = p.facts if p is not None else {}
        try:
            return await self.runtime.adopt(rec.id, facts)
        except Exception:
            log.exception("recovery: adopting %s failed", rec.id)
            await self.kill_quietly(rec.id)
            return None

    async def find_snapshot(self, runtime_id: str) -> SnapshotRef | None:
        try:
            return await self.runtime.find_snapshot(runtime_id)
        except Exception:
            log.exception("recovery: looking up snapshot %s failed", runtime_id)
            return None

    async def has_snapshot(self, store_id: str | None) -> bool:
        if not store_id:
            return False
        try:
            await self.db(self.store.get_snapshot, store_id)
            return True
        except SnapshotNotFound:
            return False

    def ev(self, rec: SandboxRecord, **more: Any) -> dict[str, Any]:
        return {"op": self.op, "from": rec.state.value, **more}

    # ---- outcomes ----------------------------------------------------------------------

    async def to_running(self, rec: SandboxRecord, placement: Placement) -> S:
        end_at = rec.end_at if rec.end_at is not None else self.clock() + (rec.ttl_left_s or 0)
        await self.db(self.store.transition, rec.id, {rec.state}, S.RUNNING, event=self.ev(rec),
                      end_at=end_at, ttl_left_s=None,
                      runtime=with_runtime(rec, pending=None,
                                           placement=placement_to_json(placement)))
        return S.RUNNING

    async def to_paused(self, rec: SandboxRecord, snapshot_id: str, *,
                        pause_mode: str | None = None) -> S:
        await self.kill_quietly(rec.id)  # no VM, network or stack may stay behind
        ttl_left = rec.ttl_left_s
        if rec.end_at is not None:
            ttl_left = max(0.0, rec.end_at - self.clock())
        if rec.state is S.RUNNING:  # running -> paused goes through pausing
            rec = await self.db(self.store.transition, rec.id, {S.RUNNING}, S.PAUSING)
        await self.db(self.store.transition, rec.id, {rec.state}, S.PAUSED, event=self.ev(rec),
                      snapshot_id=snapshot_id, end_at=None, ttl_left_s=ttl_left,
                      runtime=with_runtime(rec, pending=None, placement=None,
                                           **({"pause_mode": pause_mode} if pause_mode
                                              else {})))
        return S.PAUSED

    async def to_killed(self, rec: SandboxRecord) -> S:
        await self.kill_quietly(rec.id)
        if rec.state is not S.CREATING and rec.state is not S.KILLING:
            rec = await self.db(self.store.transition, rec.id, {rec.state}, S.KILLING)
        await self.db(self.store.transition, rec.id, {rec.state}, S.KILLED, event=self.ev(rec),
                      end_at=self.clock(), runtime=with_runtime(rec, pending=None, placement=None))
        return S.KILLED

    async def paused_or_killed(self, rec: SandboxRecord) -> S:
        if await self.has_snapshot(rec.snapshot_id):
            assert rec.snapshot_id is not None
            return await self.to_paused(rec, rec.snapshot_id)
        return await self.to_killed(rec)

    async def drop_pending(self, rec: SandboxRecord) -> None:
        """A snapshot that was being written when the service stopped and was never
        acknowledged: remove it from the runtime if it got that far."""
        pending = rec.runtime.get("pending") or {}
        if pending and not await self.has_snapshot(pending.get("store_id")):
            with contextlib.suppress(Exception):
                if await self.find_snapshot(pending["runtime_id"]) is not None:
                    await self.runtime.delete_snapshot(pending["runtime_id"])

    # ---- per state ---------------------------------------------------------------------

    async def recover_one(self, rec: SandboxRecord) -> S:
        st = rec.state
        if st in (S.PAUSED, S.KILLED):
            return st
        if st is S.CREATING or st is S.KILLING:
            return await self.to_killed(rec)
        if st is S.PAUSING:
            return await self.recover_pausing(rec)
        if st is S.RESUMING:
            placement = await self.adopt(rec)
            if placement is not None:
                try:
                    await self.envd.init(placement, token=rec.envd_token,
                                         current_token=rec.envd_token, env_vars=rec.env_vars,
                                         guest=guest_of(rec))
                    return await self.to_running(rec, placement)
                except Exception:
                    log.exception("recovery: re-init of %s failed", rec.id)
            return await self.paused_or_killed(rec)
        # running, snapshotting, forking
        if st is not S.RUNNING:
            await self.drop_pending(rec)
        placement = await self.adopt(rec)
        if placement is None:
            return await self.keep_disk(rec)
        if st is S.RUNNING or await self.envd.healthy(placement):
            return await self.to_running(rec, placement)
        return await self.pause_unresponsive(rec)

    async def pause_unresponsive(self, rec: SandboxRecord) -> S:
        """A VM adopted in the middle of a snapshot may keep its vCPUs stopped (adoption
        does not resume them), so envd never answers. Its memory and disk are intact:
        finish the job as a pause with a fresh snapshot, so nothing written is lost."""
        log.warning("recovery: adopted %s (%s) but envd does not answer: pausing it",
                    rec.id, rec.state.value)
        snap_id = ids.new_runtime_snapshot_id("pause")
        rec = await self.db(self.store.update_fields, rec.id, runtime=with_runtime(
            rec, pending={"store_id": snap_id, "runtime_id": snap_id, "kind": "pause"}))
        try:
            ref = await self.runtime.snapshot(rec.id, snap_id, stop=True)
        except Exception:
            log.exception("recovery: pausing unresponsive %s failed", rec.id)
            await self.kill_quietly(rec.id)
            return await self.paused_or_killed(rec)
        await self.db(self.store.insert_snapshot, SnapshotRecord(
            id=snap_id, kind="pause", created_at=ref.created_at, sandbox_id=rec.id,
            parent_id=ref.parent_id, spec={"ref": ref_to_json(ref), "envd_token": rec.envd_token,
                                           "template_id": rec.template_id}))
        return await self.to_paused(rec, snap_id)

    async def recover_pausing(self, rec: SandboxRecord) -> S:
        pending = rec.runtime.get("pending") or {}
        store_id, runtime_id = pending.get("store_id"), pending.get("runtime_id")
        if store_id and await self.has_snapshot(store_id):
            return await self.to_paused(rec, store_id)
        if runtime_id:
            ref = await self.find_snapshot(runtime_id)
            if ref is not None:  # committed by the runtime, not yet recorded
                await self.db(self.store.insert_snapshot, SnapshotRecord(
                    id=store_id or runtime_id, kind="pause", created_at=ref.created_at,
                    sandbox_id=rec.id, parent_id=ref.parent_id,
                    spec={"ref": ref_to_json(ref), "envd_token": rec.envd_token,
                          "template_id": rec.template_id}))
                return await self.to_paused(rec, store_id or runtime_id)
        placement = await self.adopt(rec)
        if placement is None:
            return await self.keep_disk(rec)
        if await self.envd.healthy(placement):
            return await self.to_running(rec, placement)
        return await self.pause_unresponsive(rec)

    async def keep_disk(self, rec: SandboxRecord) -> S:
        """Its VM is gone (it died while the service was down), its disk may not be:
        keep that disk as a filesystem-only pause (resumed by a cold boot), so what the
        sandbox wrote since its last snapshot is not lost; else the last snapshot."""
        p = placement_of(rec)
        salvage = getattr(self.runtime, "salvage", None)
        if p is not None and salvage is not None:
            snap_id = ids.new_runtime_snapshot_id("pause")
            try:
                ref = await salvage(rec.id, p.facts, snap_id)
            except Exception:
                log.exception("recovery: keeping the disk of %s failed", rec.id)
                ref = None
            if ref is not None:
                await self.db(self.store.insert_snapshot,
                              snapshot_record(snap_id, "pause", ref, rec))
                log.warning("recovery: the VM of %s was gone; paused it on its disk (%s)",
                            rec.id, snap_id)
                return await self.to_paused(rec, snap_id, pause_mode="filesystem")
        return await self.paused_or_killed(rec)


async def settle_exited(store: Store, runtime: SandboxRuntime, envd: EnvdClient,
                        rec: SandboxRecord, *, clock: Callable[[], float] = time.time) -> S:
    """A running sandbox whose VM ended by itself: paused on its last snapshot when it has
    one (what it did since is lost), else killed; nothing of the VM stays behind."""
    return await _Recovery(store, runtime, envd, clock, op="vm_exited").paused_or_killed(rec)


async def recover(store: Store, runtime: SandboxRuntime, envd: EnvdClient, *,
                  clock: Callable[[], float] = time.time) -> dict[str, S]:
    """Settle every sandbox to running, paused or killed; reap the rest. Returns the new
    state of each sandbox that was not already paused or killed."""
    r = _Recovery(store, runtime, envd, clock)
    outcome: dict[str, S] = {}
    for rec in await r.db(store.list_sandboxes):
        if rec.state in (S.PAUSED, S.KILLED):
            continue
        try:
            outcome[rec.id] = await r.recover_one(rec)
        except Exception:
            log.exception("recovery of sandbox %s failed", rec.id)
        else:
            log.info("recovery: %s %s -> %s", rec.id, rec.state.value, outcome[rec.id].value)
    live = {rec.id for rec in await r.db(store.list_sandboxes, {S.RUNNING})}
    try:
        reaped = await runtime.reap_orphans(live)
    except Exception:
        log.exception("recovery: reaping orphans failed")
    else:
        if reaped:
            log.info("recovery: reaped orphans %s", reaped)
    return outcome
