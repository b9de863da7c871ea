"""Draining: where VMs cannot outlive the service, a stop pauses them first.

Under systemd a restart keeps the VMs (`KillMode=process`) and the next start adopts them
(recovery.py). In a container they are the container's processes: a restart, an image
upgrade or a rollout kills them, and recovery could salvage only their disks. With
`--drain-on-stop` (the container deploys turn it on), a stop first:

1. refuses new starts (429 with Retry-After: the SDKs retry) and turns `/health`
   unhealthy ("draining": readiness goes false, a load balancer stops sending);
2. releases the VMs held for speed (warm, kept after pauses);
3. pauses every running sandbox with its memory, committed (in a cluster, with its
   handoff: another node may resume it meanwhile), `concurrency` at a time, marking each
   `drained` in its record; starts and resumes still in flight finish first (they hold
   the sandbox's lock) and are paused in a later round;

then the service exits. The next start resumes every drained sandbox in the background,
with the TTL it had left, and its first request through the proxy resumes it at once
(guest_access.route), whatever its autoResume: it was not its user who paused it.

In a cluster the node sends a heartbeat before the drain (the scheduler places nothing
more here) and one after it, so the cluster index has the drained sandboxes paused: while
the node is away a connect resumes one on another node from its handoff, where it would
otherwise count as lost with its node. Back, the node resumes the rest only after its
first heartbeat, which makes it forget the ones taken over (host/cluster/heartbeat.py's
`joined`): resumed before, those would run twice.

A crash mid-drain loses nothing committed: a sandbox whose pause was committed is paused
(and resumed as above when marked, or by its user); one still running died with the
container and recovery salvages its disk, as without a drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from . import pausing
from .opcontext import Context
from .records import DRAINED, drained, with_runtime
from .states import SandboxState as S

log = logging.getLogger(__name__)

ROUNDS = 5  # passes over the running sandboxes (in-flight starts end as running ones)


@dataclass
class DrainReport:
    paused: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    released_spare: int = 0
    seconds: float = 0.0


async def drain(ctx: Context, *, release_spare: int, concurrency: int) -> DrainReport:
    """Pause every running sandbox of the node, committed (module doc). `release_spare`:
    what releasing the warm and kept VMs released (done by the caller first)."""
    t0 = time.perf_counter()
    report = DrainReport(released_spare=release_spare)
    gauge = ctx.metrics.drain_sandboxes

    def progress() -> None:
        gauge.labels("paused").set(len(report.paused))
        gauge.labels("failed").set(len(report.failed))
        ctx.metrics.drain_seconds.set(time.perf_counter() - t0)

    async def one(sid: str) -> None:
        try:
            await pausing.pause(ctx, sid, memory=True, early=False, keep=False)
            rec = await ctx.record(sid)
            await ctx.db(ctx.store.update_fields, sid,
                         runtime=with_runtime(rec, **{DRAINED: True}))
            report.paused.append(sid)
            log.info("drain: sandbox %s paused (%d so far, %.1f s)", sid,
                     len(report.paused), time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - the others go on; recovery salvages it
            report.failed[sid] = str(exc)
            log.warning("drain: pausing sandbox %s failed: %s", sid, exc)
        progress()

    for _ in range(ROUNDS):
        running = [r.id for r in await ctx.db(ctx.store.list_sandboxes, {S.RUNNING})
                   if r.id not in report.failed]
        if not running:
            break
        gauge.labels("running").set(len(running))
        log.info("drain: pausing %d running sandboxes", len(running))
        await _each(running, one, concurrency)
    report.seconds = time.perf_counter() - t0
    progress()
    log.info("drain: %d sandboxes paused, %d failed, %d spare VMs released, in %.1f s",
             len(report.paused), len(report.failed), release_spare, report.seconds)
    return report


async def resume_drained(ctx: Context, *, concurrency: int) -> int:
    """Resume the sandboxes a drain paused (at the start after it); how many resumed.
    One that fails stays paused, marked: its first request tries again."""
    recs = [r for r in await ctx.db(ctx.store.list_sandboxes, {S.PAUSED})
            if drained(r.runtime)]
    if not recs:
        return 0
    t0 = time.perf_counter()
    resumed = 0

    async def one(sid: str) -> None:
        nonlocal resumed
        try:
            _, did = await pausing.connect(ctx, sid, None)
            resumed += did
        except Exception as exc:  # noqa: BLE001 - the others go on
            log.warning("sandbox %s, paused by the last drain: resuming failed: %s "
                        "(its first request tries again)", sid, exc)

    await _each([r.id for r in recs], one, concurrency)
    log.info("resumed %d of the %d sandboxes the last drain paused in %.1f s", resumed,
             len(recs), time.perf_counter() - t0)
    return resumed


async def _each(ids: list[str], fn: Callable[[str], Awaitable[None]], concurrency: int) -> None:
    """`fn` on every id, `concurrency` at a time (each handles its own errors)."""
    slots = asyncio.Semaphore(max(1, concurrency))

    async def one(sid: str) -> None:
        async with slots:
            await fn(sid)

    await asyncio.gather(*(one(sid) for sid in ids))
