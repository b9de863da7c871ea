"""Sandbox TTLs: setting and extending them, finding and expiring the sandboxes whose TTL
ran out, and settling those whose VM exited by itself. ttl.py's loop calls `expired`,
`expire` and `vm_exited` (through `NodeOrchestrator`).

A running sandbox has `end_at`; pausing stores the TTL left (`ttl_left_s`) and clears
`end_at`, so time spent paused does not count.
"""

from __future__ import annotations

import contextlib
import logging

from . import lifecycle, pausing, snapshots
from .errors import GuestUnresponsive, SandboxNotFound
from .opcontext import Context
from .recovery import settle_exited
from .states import SandboxState as S

log = logging.getLogger(__name__)


async def set_timeout(ctx: Context, sandbox_id: str, timeout_s: int) -> None:
    ctx.check_timeout(timeout_s)
    async with ctx.lock(sandbox_id):
        rec = await ctx.record(sandbox_id)
        if rec.end_at is None:  # paused: the TTL it gets when resumed
            await ctx.db(ctx.store.update_fields, sandbox_id, ttl_left_s=float(timeout_s))
        else:
            await ctx.db(ctx.store.update_fields, sandbox_id, end_at=ctx.clock() + timeout_s)


async def extend_timeout(ctx: Context, sandbox_id: str, duration_s: int) -> None:
    """Keep alive for at least `duration_s` more seconds (never shortens)."""
    ctx.check_timeout(duration_s, "duration")
    async with ctx.lock(sandbox_id):
        rec = await ctx.record(sandbox_id)
        if rec.end_at is None:
            left = max(rec.ttl_left_s or 0.0, float(duration_s))
            await ctx.db(ctx.store.update_fields, sandbox_id, ttl_left_s=left)
        else:
            end = max(rec.end_at, ctx.clock() + duration_s)
            await ctx.db(ctx.store.update_fields, sandbox_id, end_at=end)


async def vm_exited(ctx: Context, sandbox_id: str) -> str | None:
    """The watchdog's handler for a running sandbox whose VM ended by itself: end its
    proxied streams, release what the VM held, and settle it to paused (on its last
    snapshot) or killed. Returns the new state, or None when nothing was to be done."""
    async with ctx.lock(sandbox_id):
        try:
            rec = await ctx.record(sandbox_id)
        except SandboxNotFound:
            return None
        if rec.state is not S.RUNNING or sandbox_id not in ctx.runtime.exited():
            return None  # an operation got there first
        log.warning("sandbox %s: its VM exited on its own", sandbox_id)
        ctx.end_run(sandbox_id, "stopped (its VM exited)")
        # Its disk outlives the VM (the block server holds the upper): keep it as a
        # filesystem-only pause, resumed by a cold boot, rather than fall back to the
        # last snapshot and lose what the sandbox wrote since (or kill it: none).
        try:
            await pausing.pause_locked(ctx, rec, op="vm_exited", memory=False)
        except Exception as exc:  # noqa: BLE001 - any failure: the old way still settles it
            log.warning("sandbox %s: keeping its disk failed (%s); settling it on its last "
                        "snapshot", sandbox_id, exc)
        else:
            log.info("sandbox %s: paused with its disk as it was when the VM exited",
                     sandbox_id)
            return S.PAUSED.value
        rec = await ctx.record(sandbox_id)
        state = await settle_exited(ctx.store, ctx.runtime, ctx.envd, rec, clock=ctx.clock)
    return state.value


async def expired(ctx: Context) -> list[str]:
    """Running sandboxes whose TTL has run out."""
    now = ctx.clock()
    recs = await ctx.db(ctx.store.list_sandboxes, {S.RUNNING})
    return [r.id for r in recs if r.end_at is not None and r.end_at <= now]


async def expire(ctx: Context, sandbox_id: str) -> str | None:
    """Pause (autoPause) or kill a sandbox whose TTL ran out; re-checked under its lock
    (the TTL may have been extended meanwhile). Returns "paused", "killed" or None."""
    async with ctx.lock(sandbox_id):
        try:
            rec = await ctx.record(sandbox_id)
        except SandboxNotFound:
            return None
        if rec.state is not S.RUNNING or rec.end_at is None or rec.end_at > ctx.clock():
            return None
        if rec.auto_pause:
            memory = rec.runtime.get("auto_pause_memory", True)
            if not memory:
                try:
                    await pausing.check_guest(ctx, rec, sync=True)
                except GuestUnresponsive as exc:  # keep everything rather than lose data
                    log.warning("%s; pausing it with its memory instead", exc)
                    memory = True
            await pausing.pause_locked(ctx, rec, op="timeout", memory=memory)
            return "paused"
        await lifecycle.kill_locked(ctx, rec, op="timeout")
    ctx.drop_lock(sandbox_id)
    with contextlib.suppress(Exception):
        await snapshots.collect_snapshots(ctx)
    return "killed"
