"""What a sandbox's guest exposes to clients: its metrics (from envd), its logs (the store's
events plus the VM console), its egress rules, and the proxy's route into it (resuming a
paused sandbox with autoResume; the route carries the run's end event, see
`Context.end_run`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from host.contract import NetworkConfig

from . import pausing
from .errors import OperationFailed, StateConflict
from .model import LogLine, Metric, Route, RunEnded
from .opcontext import Context
from .records import LIVE, drained, network_from_json, network_to_json, placement_of
from .states import SandboxState as S


async def metrics(ctx: Context, sandbox_id: str) -> Sequence[Metric]:
    rec = await ctx.record(sandbox_id)
    placement = placement_of(rec)
    if rec.state not in LIVE or placement is None:
        return []
    try:
        return [await ctx.envd.metrics(placement, rec.envd_token)]
    except OperationFailed:
        # the VM may have gone meanwhile (its timeout's pause, a kill): nothing to measure
        # then, as for any sandbox not running; a running one that does not answer is an error
        now = await ctx.db(ctx.store.get_sandbox, sandbox_id)
        if now.state not in LIVE or placement_of(now) != placement:
            return []
        raise


async def logs(ctx: Context, sandbox_id: str, start_ms: int | None,
               limit: int) -> Sequence[LogLine]:
    rec = await ctx.db(ctx.store.get_sandbox, sandbox_id)
    lines = []
    for ev in await ctx.db(ctx.store.events, sandbox_id, limit=100_000):
        detail = dict(ev.detail)
        op = detail.pop("op", ev.kind)
        text = f"sandbox {op}" + "".join(f" {k}={v}" for k, v in sorted(detail.items()))
        level = "error" if "error" in detail else "info"
        lines.append(LogLine(timestamp=ev.ts, line=text, level=level))
    if rec.state in LIVE:
        now = ctx.clock()
        with contextlib.suppress(Exception):
            lines += [LogLine(timestamp=now, line=ln, level="debug")
                      for ln in await ctx.runtime.console_log(sandbox_id)]
    if start_ms is not None:
        lines = [ln for ln in lines if ln.timestamp * 1000 >= start_ms]
    return lines[:limit]


async def update_network(ctx: Context, sandbox_id: str, network: NetworkConfig) -> None:
    async with ctx.lock(sandbox_id):
        rec = await ctx.record(sandbox_id)
        if rec.state in LIVE:
            try:
                await ctx.runtime.update_network(sandbox_id, network)
            except Exception as exc:
                raise OperationFailed(f"updating the network of {sandbox_id} failed: "
                                      f"{exc}") from exc
        # A paused sandbox gets it at resume (runtime.start takes the network).
        await ctx.db(ctx.store.update_fields, sandbox_id, network=network_to_json(network))


async def route(ctx: Context, sandbox_id: str, port: int, *, resume: bool) -> Route:
    rec = await ctx.record(sandbox_id)
    # a sandbox a drain paused resumes too: its user never paused it (drain.py)
    if rec.state not in LIVE and resume and (rec.auto_resume or drained(rec.runtime)) \
            and rec.state in (S.PAUSED, S.PAUSING, S.RESUMING):
        await pausing.connect(ctx, sandbox_id, None)
        rec = await ctx.record(sandbox_id)
    placement = placement_of(rec)
    if rec.state not in LIVE or placement is None:
        raise StateConflict(sandbox_id, rec.state, LIVE)
    try:
        host, target = placement.address(port)
    except KeyError:
        raise OperationFailed(f"port {port} of sandbox {sandbox_id} is not forwarded "
                              "(user-mode networking forwards envd only)") from None
    run = ctx.runs.get(sandbox_id)
    if run is None:
        run = ctx.runs[sandbox_id] = RunEnded()
    return Route(host=host, port=target, traffic_token=rec.traffic_token,
                 mask_request_host=network_from_json(rec.network).mask_request_host, gone=run)
