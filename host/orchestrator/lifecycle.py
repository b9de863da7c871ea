"""Creating and killing sandboxes.

Create resolves the template (a built template's tagged build, templates.py; the default
one is built on first use, once even when many creates race), persists `creating`, starts
the VM from the template's snapshot, /inits envd (with the template's user, workdir and
env) and moves to `running`, or to `killed` on failure. Creates with an idempotency key return
the sandbox of the first request with that key. Kill moves to `killing`, stops the VM, then
`killed`, and collects the snapshots nobody can reach any more (snapshots.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time

from host.contract import NetworkConfig
from host.metrics import bind_sandbox

from . import handoff, ids, mounts, snapshots
from .errors import (
    IdempotencyMismatch,
    IncompatibleSnapshot,
    OperationFailed,
    OrchestratorError,
    SandboxNotFound,
    SnapshotNotFound,
    start_failed,
)
from .model import CreateRequest, SandboxInfo
from .opcontext import Context, observed
from .records import (
    GONE,
    guest_of,
    network_to_json,
    placement_to_json,
    ref_to_json,
    sandbox_info,
    snapshot_guest,
    snapshot_ref,
    with_runtime,
)
from .states import SandboxState as S
from .store import SandboxRecord, SnapshotRecord
from .templates import catalog
from .templates import lookup as templates

log = logging.getLogger(__name__)


# ---- create --------------------------------------------------------------------------

async def create(ctx: Context, req: CreateRequest) -> SandboxInfo:
    ctx.check_timeout(req.timeout_s)
    if req.idempotency_key:
        return await _create_idempotent(ctx, req, req.idempotency_key)
    return await ctx.shielded(_create(ctx, req))


async def _create_idempotent(ctx: Context, req: CreateRequest, key: str) -> SandboxInfo:
    body = json.dumps({k: v for k, v in dataclasses.asdict(req).items()
                       if k != "idempotency_key"}, sort_keys=True, default=str)
    new, sandbox_id, stored = await ctx.db(ctx.store.claim_idempotency_key, key, body)
    if not new:
        if stored != body:
            raise IdempotencyMismatch(key)
        if sandbox_id is not None:
            return sandbox_info(await ctx.db(ctx.store.get_sandbox, sandbox_id))
        inflight = ctx.idempotent.get(key)
        if inflight is not None:
            return await asyncio.shield(inflight)
        # else: a claim left by a service that died mid-create; create now.
    task = ctx.spawn(_create_bound(ctx, req, key))
    ctx.idempotent[key] = task
    task.add_done_callback(lambda _: ctx.idempotent.pop(key, None))
    return await asyncio.shield(task)


async def _create_bound(ctx: Context, req: CreateRequest, key: str) -> SandboxInfo:
    try:
        info = await _create(ctx, req)
    except BaseException:
        with contextlib.suppress(Exception):
            await ctx.db(ctx.store.bind_idempotency_key, key, None)
        raise
    await ctx.db(ctx.store.bind_idempotency_key, key, info.sandbox_id)
    return info


@observed("create")
async def _create(ctx: Context, req: CreateRequest) -> SandboxInfo:
    volume_mounts = await mounts.check(ctx, req.volume_mounts)
    built = await templates.sandbox_source(ctx, req.template_id)
    if built is not None:  # a template built through the build API, by id or name[:tag]
        snap, tmpl = built
        info = await new_sandbox(
            ctx, snap, template_id=tmpl.id, alias=tmpl.aliases[0] if tmpl.aliases else None,
            timeout_s=req.timeout_s, auto_pause=req.auto_pause, auto_resume=req.auto_resume,
            metadata=req.metadata, env_vars=req.env_vars, network=req.network,
            secure=req.secure, parent_id=None, op="created",
            auto_pause_memory=req.auto_pause_memory, warm=True, volume_mounts=volume_mounts)
        await templates.count_spawn(ctx, tmpl.id)
        return info
    source = await resolve_template(ctx, req.template_id)
    is_default = source.id == ctx.default_template

    async def create_from(src: SnapshotRecord) -> SandboxInfo:
        return await new_sandbox(
            ctx, src, template_id=src.id, alias=ctx.default_template if is_default else None,
            timeout_s=req.timeout_s, auto_pause=req.auto_pause, auto_resume=req.auto_resume,
            metadata=req.metadata, env_vars=req.env_vars, network=req.network,
            secure=req.secure, parent_id=None, op="created",
            auto_pause_memory=req.auto_pause_memory, warm=True, volume_mounts=volume_mounts)

    try:
        return await create_from(source)
    except IncompatibleSnapshot:
        if not is_default:
            raise
        return await create_from(await rebuild_stale_default(ctx, source))


async def resolve_template(ctx: Context, template_id: str) -> SnapshotRecord:
    """The snapshot to start from: the default template (built on first use, once even
    when many creates race), or a template / named snapshot by its store id (built
    templates by name: templates.sandbox_source)."""
    tid = ctx.default_template if template_id in ctx.template_aliases else template_id
    for candidate in (tid, f"{tid}:default"):
        with contextlib.suppress(SnapshotNotFound):
            snap = await ctx.db(ctx.store.get_snapshot, candidate)
            if snap.kind in ("template", "named") and await catalog.still_named(ctx, snap):
                return snap
    if tid != ctx.default_template:
        for candidate in (tid, f"{tid}:default"):   # another node's, in a cluster
            found = await catalog.find_named(ctx, candidate)
            if found is not None:
                return found
        raise SnapshotNotFound(template_id)
    async with ctx.template_locks.hold(tid):
        with contextlib.suppress(SnapshotNotFound):
            return await ctx.db(ctx.store.get_snapshot, tid)
        log.info("building template %r (first use)", tid)
        return await _build_default(ctx, tid)


async def rebuild_stale_default(ctx: Context, stale: SnapshotRecord) -> SnapshotRecord:
    """The default template's memory was saved under a VMM configuration this node no
    longer runs (an upgrade changed QEMU, its flags or the guest's command line): build
    it again, once even when many creates find it stale at the same time. Sandboxes
    paused on the old one keep their own snapshots (they resume with a reboot)."""
    async with ctx.template_locks.hold(stale.id):
        current = await ctx.db(ctx.store.get_snapshot, stale.id)
        if current.spec != stale.spec:  # another create rebuilt it meanwhile
            return current
        log.warning("template %r was built for another VMM configuration: rebuilding it",
                    stale.id)
        return await _build_default(ctx, stale.id)


async def _build_default(ctx: Context, tid: str) -> SnapshotRecord:
    try:
        # its own runtime snapshot id: nodes sharing one repository each build theirs,
        # and a pause's memory diff names the base it was taken on by that id
        ref = await ctx.runtime.build_template(ids.new_runtime_snapshot_id("template"),
                                               ctx.machine)
    except Exception as exc:
        raise OperationFailed(f"building template '{tid}' failed: {exc}") from exc
    snap = SnapshotRecord(id=tid, kind="template", created_at=ref.created_at,
                          parent_id=ref.parent_id,
                          spec={"ref": ref_to_json(ref), "envd_token": None})
    return await ctx.db(ctx.store.insert_snapshot, snap)


async def new_sandbox(ctx: Context, source: SnapshotRecord, *, template_id: str,
                      alias: str | None, timeout_s: int, auto_pause: bool, auto_resume: bool,
                      metadata: dict[str, str], env_vars: dict[str, str],
                      network: NetworkConfig, secure: bool, parent_id: str | None,
                      op: str, auto_pause_memory: bool = True,
                      warm: bool = False,
                      volume_mounts: list[dict[str, str]] | None = None,
                      fanout: int = 1) -> SandboxInfo:
    """Persist `creating`, start from `source`, /init envd (with the guest defaults of
    the template or sandbox `source` was made from), then `running` (or killed). `warm`:
    a create from a template, which may continue a warm VM (warm.py) under its id.
    `fanout`: the starts of `source` made at once (a fork's count; the runtime's hint)."""
    ref = snapshot_ref(source)
    held_token = source.spec.get("envd_token")
    guest = snapshot_guest(source)
    taken = ctx.warm.take(ref, network) if warm and ctx.warm is not None else None
    sandbox_id = taken or ids.new_sandbox_id()
    bind_sandbox(sandbox_id)  # for the log records of the rest of this (create or fork) task
    # A snapshot taken after an /init keeps that token inside envd: the new sandbox
    # must get its own token then, or it would answer to the source's.
    token = ids.new_envd_token() if (secure or held_token) else None
    now = ctx.clock()
    rec = SandboxRecord(
        id=sandbox_id, template_id=template_id, alias=alias, state=S.CREATING,
        cpu_count=ref.machine.cpu_count, memory_mb=ref.machine.memory_mb,
        disk_mb=ref.machine.disk_mb, started_at=now, end_at=now + timeout_s,
        auto_pause=auto_pause, auto_resume=auto_resume, metadata=dict(metadata),
        env_vars=dict(env_vars), envd_token=token,
        traffic_token=None if network.allow_public_traffic else ids.new_traffic_token(),
        network=network_to_json(network),
        runtime={"origin": source.id, **({} if auto_pause_memory else
                                         {"auto_pause_memory": False}),
                 **({"guest": guest} if guest else {}),
                 **({mounts.KEY: volume_mounts} if volume_mounts else {})},
        parent_id=parent_id)

    async def drop_taken() -> None:
        """A create that fails before its start continued the warm VM it took: that VM
        must not linger (it has no record that recovery would find)."""
        if taken:
            with contextlib.suppress(Exception):
                await ctx.runtime.kill(sandbox_id)

    async with ctx.lock(sandbox_id):
        try:
            await ctx.db(ctx.store.insert_sandbox, rec,
                         event={"op": "create", "source": source.id})
        except BaseException:
            await drop_taken()
            raise
        try:
            async with ctx.admission.start(sandbox_id, ref.machine.memory_mb,
                                           ctx.vm_holders):
                placement = await ctx.runtime.start(sandbox_id, ref, network, fanout=fanout)
        except Exception as exc:
            await drop_taken()
            await ctx.db(ctx.store.transition, sandbox_id, {S.CREATING}, S.KILLED,
                         event={"op": "create_failed", "error": str(exc)})
            raise start_failed(f"starting sandbox {sandbox_id} failed: {exc}", exc) from exc
        try:
            await ctx.envd.init(placement, token=token, current_token=held_token,
                                env_vars=rec.env_vars, guest=guest_of(rec),
                                volume_mounts=await mounts.attach(ctx, sandbox_id,
                                                                  volume_mounts or []))
            now = ctx.clock()
            rec = await ctx.db(
                ctx.store.transition, sandbox_id, {S.CREATING}, S.RUNNING,
                event={"op": op}, started_at=now, end_at=now + timeout_s,
                runtime=with_runtime(rec, placement=placement_to_json(placement)))
        except Exception as exc:
            await ctx.release(sandbox_id)
            await mounts.detach(ctx, sandbox_id)
            await ctx.db(ctx.store.transition, sandbox_id, {S.CREATING}, S.KILLED,
                         event={"op": "create_failed", "error": str(exc)})
            if isinstance(exc, OrchestratorError):
                raise
            raise OperationFailed(f"initializing sandbox {sandbox_id} failed: {exc}") from exc
    return sandbox_info(rec, now=ctx.clock())


# ---- kill ----------------------------------------------------------------------------

async def kill(ctx: Context, sandbox_id: str) -> None:
    await ctx.shielded(_kill(ctx, sandbox_id))


@observed("kill")
async def _kill(ctx: Context, sandbox_id: str, op: str = "killed") -> None:
    async with ctx.lock(sandbox_id):
        await kill_locked(ctx, await ctx.record(sandbox_id), op)
    ctx.drop_lock(sandbox_id)
    try:
        await snapshots.collect_snapshots(ctx)
    except Exception:
        log.exception("snapshot garbage collection failed")


@observed("kill")
async def kill_locked(ctx: Context, rec: SandboxRecord, op: str) -> None:
    """Kill `rec`'s sandbox (any state but gone); the caller holds its lock."""
    movable = {s for s in S if s not in GONE}
    await ctx.db(ctx.store.transition, rec.id, movable, S.KILLING, event={"op": op})
    ctx.end_run(rec.id, "killed" if op != "timeout" else "killed (its timeout ran out)")
    if ctx.kept is not None:
        ctx.kept.take(rec.id)  # a paused sandbox's kept VM goes with the kill below
    await _finish_kill(ctx, rec)


async def _finish_kill(ctx: Context, rec: SandboxRecord) -> None:
    """killing -> killed once the runtime has removed the VM, its network and its stack.
    On failure the sandbox stays `killing` (invisible, still counted by admission) and
    the TTL loop retries (`retry_kill`), as recovery does at the next start."""
    try:
        await ctx.runtime.kill(rec.id)
    except Exception as exc:
        raise OperationFailed(f"killing sandbox {rec.id} failed: {exc}") from exc
    await ctx.db(ctx.store.transition, rec.id, {S.KILLING}, S.KILLED,
                 end_at=ctx.clock(), runtime=with_runtime(rec, placement=None))
    if rec.state is S.PAUSED:
        await handoff.withdraw(ctx, rec.id)


async def unfinished_kills(ctx: Context, older_than_s: float) -> list[str]:
    """Sandboxes left `killing` by a kill that failed more than `older_than_s` ago (a
    kill in progress is younger, or holds the sandbox's lock)."""
    before = time.time() - older_than_s  # the store's update times are wall-clock
    recs = await ctx.db(ctx.store.list_sandboxes, {S.KILLING})
    return [r.id for r in recs if r.updated_at < before]


async def retry_kill(ctx: Context, sandbox_id: str) -> str | None:
    """Kill again a sandbox a failed kill left `killing`; "killed", or None when there
    was nothing left to do (another operation finished it)."""
    async with ctx.lock(sandbox_id):
        try:  # not ctx.record: a `killing` sandbox reads as gone there
            rec = await ctx.db(ctx.store.get_sandbox, sandbox_id)
        except SandboxNotFound:
            return None
        if rec.state is not S.KILLING:
            return None
        await _finish_kill(ctx, rec)
    ctx.drop_lock(sandbox_id)
    return S.KILLED.value
