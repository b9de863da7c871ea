"""Template builds (docs/e2b-template-api.md §3, §5, §6): request, start, run, status and
recovery.

`request_build` records a `waiting` build (and the template, on its first build).
`start_build` validates the steps and the source synchronously (a bad request is a 400,
nothing runs), moves the build to `building` and runs `runtime.build` as an
orchestrator-owned task; the build's log goes to a `BuildLogBuffer` (build_log.py). On
success the snapshot is recorded as kind "template", the build turns `ready` and its tags
point at it; a `BuildFailed` turns it `error` with E2B's reason {message, step}; any
other failure is an `error` with a generic message (the details go to the service log).

Builds of one template run one after another, in the order they were started (a FIFO
lock per template; a queued build is `building` and its log says it waits); builds of
different templates run concurrently. Starting the same build twice is a 400 "build is
not in waiting state", as E2B answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

from host.contract import BuildFailed, BuildSpec, BuildStep, MachineSpec, SnapshotRef

from .. import ids, lifecycle
from ..errors import (
    AliasConflict,
    AliasTaken,
    BuildNotFound,
    InvalidRequest,
    OperationFailed,
    OrchestratorError,
    SnapshotNotFound,
    TemplateNotFound,
)
from ..model import BuildLogLine, BuildRequest, BuildStart, BuildStatus, RequestedBuild
from ..opcontext import Context
from ..records import ENVD_VERSION, ref_to_json, snapshot_ref
from ..store import SnapshotRecord
from . import catalog
from . import files as template_files
from . import lookup as templates
from .build_log import BuildLogBuffer, page
from .names import TEAM, build_tags, is_files_hash, is_uuid, new_build_id, parse_name
from .names import new_template_id as fresh_template_id
from .store import ERROR, READY, WAITING, BuildRecord, LogRecord

log = logging.getLogger(__name__)

# Step types as the server accepts them (case-insensitive), and what the runtime gets.
STEP_KINDS = {"RUN": "RUN", "COPY": "COPY", "ADD": "COPY", "ENV": "ENV", "ARG": "ENV",
              "WORKDIR": "WORKDIR", "USER": "USER"}
LOG_FLUSH_S = 0.5
INTERRUPTED = ("the service restarted while this build was running; "
               "start a new build of the template")
INTERNAL = "the build failed because of an internal error (see the service log)"


# ---- request -------------------------------------------------------------------------

async def request_build(ctx: Context, req: BuildRequest) -> RequestedBuild:
    """POST /v3/templates: a waiting build of the template `req.name` names."""
    name = parse_name(req.name)
    if name.alias in ctx.template_aliases:
        raise AliasTaken(f"Alias '{name.alias}' already used")
    tags = build_tags(name, req.tags)
    for snap in await ctx.db(ctx.store.list_snapshots, kinds=["named"]):
        if snap.id.split(":", 1)[0].lower() in (name.alias, f"{TEAM}/{name.alias}"):
            raise AliasConflict(f"Alias '{name.alias}' is already used (by snapshot "
                                f"'{snap.id}')")
    now = ctx.clock()
    build = BuildRecord(
        id=new_build_id(), template_id="", status=WAITING, created_at=now, updated_at=now,
        cpu_count=req.cpu_count or ctx.machine.cpu_count,
        memory_mb=req.memory_mb or ctx.machine.memory_mb,
        # minFreeDiskMb is best effort (E2B too): that much on top of the usual disk
        disk_mb=ctx.machine.disk_mb + max(0, req.min_free_disk_mb or 0), tags=tuple(tags))
    tmpl, build = await ctx.db(ctx.templates.request_build, alias=name.alias,
                               new_template_id=fresh_template_id(), build=build)
    return RequestedBuild(template_id=tmpl.id, build_id=build.id, public=tmpl.public,
                          names=(name.full,), tags=tuple(tags), aliases=(name.alias,))


# ---- start ---------------------------------------------------------------------------

def check_steps(steps: Sequence[BuildStep]) -> tuple[BuildStep, ...]:
    """The steps as the runtime gets them (types normalized, COPY args padded to 4);
    InvalidRequest naming the first bad step."""
    out = []
    for i, step in enumerate(steps, 1):
        kind = STEP_KINDS.get(step.type.strip().upper())
        if kind is None:
            raise InvalidRequest(f"step {i}: command type '{step.type}' is not implemented "
                                 "(supported: RUN, COPY, ENV, WORKDIR, USER)")
        args = tuple(step.args)
        where = f"step {i} ({kind})"
        if kind == "RUN" and not (1 <= len(args) <= 2 and args[0].strip()):
            raise InvalidRequest(f"{where}: needs [command] or [command, user], "
                                 f"got {list(args)}")
        if kind == "COPY":
            if not 2 <= len(args) <= 4 or not args[0] or not args[1]:
                raise InvalidRequest(f"{where}: needs [src, dest, user, mode], got {list(args)}")
            args += ("",) * (4 - len(args))
            if not step.files_hash:
                raise InvalidRequest(f"{where}: 'filesHash' is required")
            if not is_files_hash(step.files_hash):
                raise InvalidRequest(f"{where}: invalid filesHash '{step.files_hash}'")
        if kind == "ENV" and (not args or len(args) % 2):
            raise InvalidRequest(f"{where}: needs key/value pairs, got {len(args)} args")
        if kind in ("WORKDIR", "USER") and not (
                1 <= len(args) <= (1 if kind == "WORKDIR" else 2) and args[0].strip()):
            raise InvalidRequest(f"{where}: needs [{kind.lower()}], got {list(args)}")
        out.append(BuildStep(type=kind, args=args, force=step.force,
                             files_hash=step.files_hash if kind == "COPY" else None))
    return tuple(out)


async def _source(ctx: Context, ref: str) -> SnapshotRecord | None:
    """The snapshot `fromTemplate` names (a built template's tagged build); None for the
    default template, resolved when the build runs (it may be built on first use).
    InvalidRequest when there is none, or when it is a sandbox's snapshot: its envd holds
    that sandbox's access token, which a build cannot pass on."""
    if ref in ctx.template_aliases:
        return None
    try:
        built = await templates.sandbox_source(ctx, ref)
        snap = built[0] if built is not None else await lifecycle.resolve_template(ctx, ref)
    except (TemplateNotFound, SnapshotNotFound) as exc:
        raise InvalidRequest(f"fromTemplate '{ref}': {exc}") from None
    if snap.kind != "template" or snap.spec.get("envd_token"):
        raise InvalidRequest(f"fromTemplate '{ref}': building from a sandbox snapshot is not "
                             "supported; build from a template")
    return snap


async def start_build(ctx: Context, template_ref: str, build_id: str,
                      start: BuildStart) -> None:
    """POST /v2/templates/{id}/builds/{buildID}: validate, then run in the background.
    An owned task: a client that goes away cannot leave the build `building` unrun."""
    await ctx.shielded(_start_build(ctx, template_ref, build_id, start))


async def _start_build(ctx: Context, template_ref: str, build_id: str,
                       start: BuildStart) -> None:
    if not is_uuid(build_id):
        raise InvalidRequest(f"invalid build ID '{build_id}': must be a UUID")
    tmpl, _ = await templates.require(ctx, template_ref)
    build = await ctx.db(ctx.templates.get_build, build_id)
    if build.template_id != tmpl.id:
        raise BuildNotFound(build_id)
    if build.status != WAITING:
        raise InvalidRequest("build is not in waiting state")
    steps = check_steps(start.steps)
    for i, step in enumerate(steps, 1):
        if step.type == "COPY" and not await template_files.present(ctx, step.files_hash or ""):
            raise InvalidRequest(f"step {i} (COPY {step.args[0]}): the files "
                                 f"'{step.files_hash}' were never uploaded")
    if bool(start.from_image) == bool(start.from_template):
        raise InvalidRequest("exactly one of 'fromImage' and 'fromTemplate' must be given")
    if start.registry is not None and not start.from_image:
        raise InvalidRequest("'fromImageRegistry' needs 'fromImage'")
    source = await _source(ctx, start.from_template) if start.from_template else None
    spec = BuildSpec(
        snapshot_id=ids.new_runtime_snapshot_id("template"),
        machine=MachineSpec(cpu_count=build.cpu_count, memory_mb=build.memory_mb,
                            disk_mb=build.disk_mb, image=ctx.machine.image),
        from_image=start.from_image or None, registry=start.registry,
        from_snapshot=snapshot_ref(source).snapshot_id if source is not None else None,
        steps=steps, start_cmd=start.start_cmd or None, ready_cmd=start.ready_cmd or None,
        force=start.force, files_dir=ctx.files_dir)
    record = {"from_image": spec.from_image, "from_template": start.from_template,
              "source": source.id if source is not None else None,
              "registry_user": start.registry.username if start.registry else None,
              "steps": [dataclasses.asdict(s) for s in steps], "start_cmd": spec.start_cmd,
              "ready_cmd": spec.ready_cmd, "force": spec.force}
    build = await ctx.db(ctx.templates.start_build, build_id, snapshot_id=spec.snapshot_id,
                         spec=record, now=ctx.clock())
    buffer = ctx.build_logs[build_id] = BuildLogBuffer(ctx.clock)
    default_source = bool(start.from_template) and source is None
    try:
        ctx.spawn(_run(ctx, build, spec, buffer, default_source=default_source))
    except OperationFailed:
        await _finish(ctx, build, buffer, ERROR, reason={"message": "the service is shutting "
                                                                    "down; start a new build"})
        raise


# ---- run -----------------------------------------------------------------------------

async def _run(ctx: Context, build: BuildRecord, spec: BuildSpec, buffer: BuildLogBuffer, *,
               default_source: bool) -> None:
    async def write(first_seq: int, entries: list[LogRecord]) -> None:
        await ctx.db(ctx.templates.append_logs, build.id, first_seq, entries)

    try:
        if ctx.build_queues.busy(build.template_id):
            buffer("info", "Waiting for the previous build of this template to finish", None)
        async with ctx.build_queues.hold(build.template_id):
            flusher = asyncio.get_running_loop().create_task(
                buffer.flush_every(write, LOG_FLUSH_S))
            try:
                if default_source:
                    base = await lifecycle.resolve_template(ctx, ctx.default_template)
                    spec = dataclasses.replace(spec, from_snapshot=snapshot_ref(base).snapshot_id)
                ref = await ctx.runtime.build(spec, buffer)
            finally:
                flusher.cancel()
                await asyncio.gather(flusher, return_exceptions=True)
    except asyncio.CancelledError:
        await _finish(ctx, build, buffer, ERROR, reason={
            "message": "the build was cancelled: the service is shutting down"})
        raise
    except BuildFailed as exc:
        reason = {"message": str(exc) or "Build failed"}
        if exc.step is not None:
            reason["step"] = str(exc.step)
        await _finish(ctx, build, buffer, ERROR, reason=reason)
    except OrchestratorError as exc:  # e.g. the default template could not be built
        await _finish(ctx, build, buffer, ERROR, reason={"message": str(exc)})
    except Exception:
        log.exception("build %s of template %s failed", build.id, build.template_id)
        await _finish(ctx, build, buffer, ERROR, reason={"message": INTERNAL})
    else:
        await _succeed(ctx, build, ref, buffer)


async def _succeed(ctx: Context, build: BuildRecord, ref: SnapshotRef,
                   buffer: BuildLogBuffer) -> None:
    await ctx.db(ctx.store.insert_snapshot, SnapshotRecord(
        id=ref.snapshot_id, kind="template", created_at=ref.created_at,
        parent_id=ref.parent_id,
        spec={"ref": ref_to_json(ref), "envd_token": None, "template_id": build.template_id,
              "build_id": build.id}))
    guest = ref.facts.get("guest")
    done = await _finish(ctx, build, buffer, READY, snapshot_id=ref.snapshot_id,
                         guest=dict(guest) if guest else None,
                         envd_version=str(ref.facts.get("envd_version") or ENVD_VERSION))
    if done:
        await templates.orphan_untagged(ctx, build.template_id)
        await catalog.publish_template(ctx, build.template_id)
    else:  # the template went away meanwhile: nobody can use the result
        await templates.orphan_snapshots(ctx, [ref.snapshot_id])


async def _finish(ctx: Context, build: BuildRecord, buffer: BuildLogBuffer, status: str,
                  **changes: object) -> bool:
    """Record the outcome: the log first (complete before the status says so), then the
    status. False when the build is gone (its template was deleted)."""
    reason = changes.get("reason")
    if isinstance(reason, dict):
        buffer("error", f"Build failed: {reason['message']}", reason.get("step"))

    async def write(first_seq: int, entries: list[LogRecord]) -> None:
        await ctx.db(ctx.templates.append_logs, build.id, first_seq, entries)

    try:
        try:
            await buffer.flush(write)
        except Exception:
            log.exception("writing the log of build %s failed", build.id)
        await ctx.db(ctx.templates.finish_build, build.id, status, now=ctx.clock(),
                     **changes)
        return True
    except BuildNotFound:
        return False
    finally:
        ctx.build_logs.pop(build.id, None)


# ---- status --------------------------------------------------------------------------

def _line(e: LogRecord) -> BuildLogLine:
    return BuildLogLine(timestamp=e.timestamp, level=e.level, message=e.message, step=e.step)


async def build_status(ctx: Context, template_ref: str, build_id: str, *, offset: int = 0,
                       limit: int = 100, level: str | None = None) -> BuildStatus:
    """GET /templates/{id}/builds/{buildID}/status: the status and a page of the log."""
    if not is_uuid(build_id):
        raise InvalidRequest(f"invalid build ID '{build_id}': must be a UUID")
    tmpl, _ = await templates.require(ctx, template_ref)
    build = await ctx.db(ctx.templates.get_build, build_id)
    if build.template_id != tmpl.id:
        raise BuildNotFound(build_id)
    live = ctx.build_logs.get(build_id)
    entries = list(live.entries) if live is not None else await ctx.db(
        ctx.templates.logs, build_id)
    lines = page(entries, offset=offset, limit=limit, level=level)
    reason = build.reason or {}
    step = reason.get("step")
    failed = [e for e in lines if step is not None and e.step == step
              and e.level in ("warn", "error")]
    return BuildStatus(template_id=tmpl.id, build_id=build.id, status=build.status,
                       entries=tuple(_line(e) for e in lines),
                       reason=reason.get("message") if build.status == ERROR else None,
                       reason_step=step, reason_entries=tuple(_line(e) for e in failed))


# ---- recovery ------------------------------------------------------------------------

async def recover(ctx: Context) -> list[str]:
    """At start: builds that were running when the service stopped are errors now (their
    half-written snapshot, if the runtime committed it, is deleted); partial uploads go.
    Returns the failed build ids."""
    failed = await ctx.db(ctx.templates.fail_unfinished, INTERRUPTED, ctx.clock())
    for b in failed:
        seq = len(await ctx.db(ctx.templates.logs, b.id))
        await ctx.db(ctx.templates.append_logs, b.id, seq, [LogRecord(
            seq=seq, timestamp=ctx.clock(), level="error", message=f"Build failed: {INTERRUPTED}")])
        if b.snapshot_id:
            try:
                if await ctx.runtime.find_snapshot(b.snapshot_id) is not None:
                    await ctx.runtime.delete_snapshot(b.snapshot_id)
            except Exception:
                log.exception("recovery: releasing the snapshot of build %s failed", b.id)
        log.warning("recovery: build %s of template %s was interrupted", b.id, b.template_id)
    await asyncio.to_thread(template_files.remove_partials, ctx.files_dir)
    return [b.id for b in failed]

