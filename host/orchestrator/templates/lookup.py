"""Built templates: lookup by id or name, the snapshot a sandbox starts from, list / get /
delete, alias lookup and tags (docs/e2b-template-api.md §9-10).

A reference is a template id, an alias, or `[namespace/]alias[:tag]`; the tag (default
`default`) picks the build whose snapshot sandboxes start from. A ready build's snapshot is
a `SnapshotRecord` of kind "template" (id = the build's snapshot id). When no tag points at
a build any more (a rebuild moved them, tags were removed, the template was deleted), its
snapshot is marked `orphaned` and the snapshot collector (snapshots.py) deletes it once no
sandbox, snapshot or running build needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from .. import snapshots
from ..errors import InvalidRequest, SnapshotNotFound, TemplateNotFound
from ..model import BuildInfo, TemplateInfo, TemplateTag
from ..opcontext import Context
from ..records import ENVD_VERSION, GONE
from ..store import SnapshotRecord
from . import catalog
from .names import DEFAULT_TAG, TEAM, check_tag, lookup_name, parse_name
from .store import BUILDING, READY, BuildRecord, TemplateRecord

log = logging.getLogger(__name__)


# ---- lookup --------------------------------------------------------------------------

async def lookup(ctx: Context, ref: str) -> tuple[TemplateRecord, str | None] | None:
    """(template, the tag `ref` names or None), or None when `ref` names no template."""
    tmpl = await _find(ctx, ref)
    if tmpl is not None:
        return tmpl, None
    name = lookup_name(ref)
    if name is None:
        return None
    tmpl = await _find(ctx, name.alias)
    return (tmpl, name.tag) if tmpl is not None else None


async def _find(ctx: Context, ref: str) -> TemplateRecord | None:
    """By id or alias: this node's, else the cluster's catalog's (catalog.py)."""
    tmpl, released = await catalog.find_template(ctx, ref)
    await orphan_snapshots(ctx, released)
    return tmpl


async def require(ctx: Context, ref: str) -> tuple[TemplateRecord, str | None]:
    """Like `lookup`; TemplateNotFound (404) when there is no such template."""
    found = await lookup(ctx, ref)
    if found is None:
        raise TemplateNotFound(f"template '{ref}' not found")
    return found


async def tagged_snapshot(ctx: Context, tmpl: TemplateRecord, tag: str | None,
                          ref: str) -> SnapshotRecord:
    """The snapshot of `tmpl`'s build tagged `tag` (default: "default")."""
    tag = tag or DEFAULT_TAG
    t = await ctx.db(ctx.templates.tag, tmpl.id, tag)
    if t is None:
        raise TemplateNotFound(f"template '{ref}' has no build tagged '{tag}'")
    build = await ctx.db(ctx.templates.get_build, t.build_id)
    if build.status != READY or not build.snapshot_id:
        raise TemplateNotFound(f"template '{ref}': build {build.id} is not ready")
    try:
        return await ctx.db(ctx.store.get_snapshot, build.snapshot_id)
    except SnapshotNotFound:
        raise TemplateNotFound(f"template '{ref}': the snapshot of build {build.id} "
                               "is missing") from None


async def sandbox_source(ctx: Context, ref: str) -> tuple[SnapshotRecord, TemplateRecord] | None:
    """What `Sandbox.create(template=ref)` starts from when `ref` names a built template;
    None when it names none (the caller then tries the default template and snapshots)."""
    if ref in ctx.template_aliases:
        return None
    found = await lookup(ctx, ref)
    if found is None:
        return None
    tmpl, tag = found
    return await tagged_snapshot(ctx, tmpl, tag, ref), tmpl


# ---- list / get ----------------------------------------------------------------------

def build_info(b: BuildRecord) -> BuildInfo:
    return BuildInfo(build_id=b.id, status=b.status, created_at=b.created_at,
                     updated_at=b.updated_at, cpu_count=b.cpu_count, memory_mb=b.memory_mb,
                     disk_mb=b.disk_mb, finished_at=b.finished_at,
                     envd_version=b.envd_version)


def template_info(tmpl: TemplateRecord, builds: list[BuildRecord], *,
                  with_builds: bool = False) -> TemplateInfo:
    """`builds`: the template's, oldest first (there is always one: it came with it)."""
    newest = builds[-1]
    ready = [b for b in builds if b.status == READY]
    return TemplateInfo(
        template_id=tmpl.id, build=build_info(newest), public=tmpl.public,
        aliases=tmpl.aliases, names=tuple(f"{TEAM}/{a}" for a in tmpl.aliases),
        cpu_count=tmpl.cpu_count, memory_mb=tmpl.memory_mb, disk_mb=tmpl.disk_mb,
        created_at=tmpl.created_at, updated_at=tmpl.updated_at,
        spawn_count=tmpl.spawn_count, last_spawned_at=tmpl.last_spawned_at,
        build_count=len(builds),
        envd_version=(ready[-1].envd_version if ready else None) or ENVD_VERSION,
        builds=tuple(build_info(b) for b in reversed(builds)) if with_builds else ())


async def list_templates(ctx: Context) -> list[TemplateInfo]:
    def read() -> list[TemplateInfo]:
        out = []
        for tmpl in ctx.templates.list_templates():
            builds = ctx.templates.list_builds(tmpl.id)
            if builds:
                out.append(template_info(tmpl, builds))
        return out
    return await ctx.db(read)


async def get_template(ctx: Context, ref: str) -> TemplateInfo:
    tmpl, _ = await require(ctx, ref)
    builds = await ctx.db(ctx.templates.list_builds, tmpl.id)
    if not builds:
        raise TemplateNotFound(f"template '{ref}' not found")
    return template_info(tmpl, builds, with_builds=True)


async def alias_info(ctx: Context, ref: str) -> tuple[str, bool]:
    """GET /templates/aliases/{alias}: (template id, public). 400 for a malformed name or
    another namespace, 404 for an unknown alias or an explicit tag it does not have."""
    name = parse_name(ref)
    if name.alias in ctx.template_aliases and name.tag in (None, DEFAULT_TAG):
        return ctx.default_template, True          # the built-in template is public
    tmpl = await ctx.db(ctx.templates.find_template, name.alias)
    if tmpl is None:
        raise TemplateNotFound(f"Alias '{name.alias}' not found")
    if name.tag is not None and await ctx.db(ctx.templates.tag, tmpl.id, name.tag) is None:
        raise TemplateNotFound(f"Template '{name.alias}' with tag '{name.tag}' not found")
    return tmpl.id, tmpl.public


# ---- delete --------------------------------------------------------------------------

async def delete_template(ctx: Context, ref: str) -> bool:
    """Delete the template `ref` names: its aliases, tags, builds and (once unused) their
    snapshots. False when `ref` names no template. Refused (400) while sandboxes started
    from it are running or paused, or while one of its builds runs."""
    return await ctx.shielded(_delete_template(ctx, ref))


async def _delete_template(ctx: Context, ref: str) -> bool:
    found = await lookup(ctx, ref)
    if found is None:
        return False
    tmpl = found[0]
    users = [r.id for r in await ctx.db(ctx.store.list_sandboxes)
             if r.state not in GONE and r.template_id == tmpl.id]
    if users:
        raise InvalidRequest(f"template '{ref}' is used by {len(users)} sandbox(es) "
                             f"(running or paused), e.g. {users[0]}; kill them first")
    if await ctx.db(ctx.templates.list_builds, tmpl.id, [BUILDING]):
        raise InvalidRequest(f"template '{ref}' has a build in progress")
    builds = await ctx.db(ctx.templates.delete_template, tmpl.id)
    await catalog.withdraw_template(ctx, tmpl, builds)
    await orphan_snapshots(ctx, [b.snapshot_id for b in builds if b.status == READY and b.snapshot_id])
    return True


async def orphan_snapshots(ctx: Context, snapshot_ids: list[str]) -> None:
    """Mark these template snapshots collectable, then collect what nothing uses."""
    for sid in snapshot_ids:
        with contextlib.suppress(SnapshotNotFound):
            snap = await ctx.db(ctx.store.get_snapshot, sid)
            if snap.kind == "template" and not snap.spec.get("orphaned"):
                await ctx.db(ctx.store.insert_snapshot, dataclasses.replace(
                    snap, spec={**snap.spec, "orphaned": True}))
    if snapshot_ids:
        try:
            await snapshots.collect_snapshots(ctx)
        except Exception:
            log.exception("snapshot garbage collection failed")


async def orphan_untagged(ctx: Context, template_id: str) -> None:
    """Release the snapshots of `template_id`'s ready builds that no tag points at."""
    builds = await ctx.db(ctx.templates.list_builds, template_id, [READY])
    tagged = {t.build_id for t in await ctx.db(ctx.templates.tags, template_id)}
    await orphan_snapshots(ctx, [b.snapshot_id for b in builds
                        if b.id not in tagged and b.snapshot_id])


# ---- tags ----------------------------------------------------------------------------

def _tags(tags: list[str] | tuple[str, ...]) -> list[str]:
    if not tags:
        raise InvalidRequest("'tags' must not be empty")
    out: list[str] = []
    for tag in tags:
        t = check_tag(tag)
        if t not in out:
            out.append(t)
    return out


async def assign_tags(ctx: Context, target: str, tags: list[str]) -> tuple[str, list[str]]:
    """Point `tags` at the build `target` (`name:tag`, default tag when none) names;
    returns (build id, tags)."""
    name = parse_name(target)
    new = _tags(tags)
    tmpl = await _own(ctx, name.alias)
    source_tag = name.tag or DEFAULT_TAG
    t = await ctx.db(ctx.templates.tag, tmpl.id, source_tag)
    if t is None:
        raise TemplateNotFound(f"Template '{name.alias}' with tag '{source_tag}' not found")
    await ctx.db(ctx.templates.assign_tags, tmpl.id, t.build_id, new, ctx.clock())
    await orphan_untagged(ctx, tmpl.id)
    await catalog.publish_template(ctx, tmpl.id)
    return t.build_id, new


async def remove_tags(ctx: Context, name_ref: str, tags: list[str]) -> None:
    name = parse_name(name_ref)
    if name.tag is not None:
        raise InvalidRequest(f"'name' must not carry a tag, got '{name_ref}'")
    gone = _tags(tags)
    if DEFAULT_TAG in gone:
        raise InvalidRequest(f"the '{DEFAULT_TAG}' tag cannot be removed")
    tmpl = await _own(ctx, name.alias)
    have = {t.tag for t in await ctx.db(ctx.templates.tags, tmpl.id)}
    missing = [t for t in gone if t not in have]
    if missing:
        raise TemplateNotFound(f"Template '{name.alias}' with tag '{missing[0]}' not found")
    await ctx.db(ctx.templates.remove_tags, tmpl.id, gone)
    await orphan_untagged(ctx, tmpl.id)
    await catalog.publish_template(ctx, tmpl.id)


async def _own(ctx: Context, alias: str) -> TemplateRecord:
    """The template called `alias` that this node may change: not found (404) when it is
    another node's copy (in a cluster, its home node moves its tags)."""
    tmpl = await ctx.db(ctx.templates.find_template, alias)
    if tmpl is None or await ctx.db(ctx.templates.is_imported, tmpl.id):
        raise TemplateNotFound(f"Template '{alias}' not found")
    return tmpl


async def list_tags(ctx: Context, ref: str) -> list[TemplateTag]:
    tmpl, _ = await require(ctx, ref)
    return [TemplateTag(tag=t.tag, build_id=t.build_id, created_at=t.created_at)
            for t in await ctx.db(ctx.templates.tags, tmpl.id)]


async def count_spawn(ctx: Context, template_id: str) -> None:
    """A sandbox started from `template_id` (spawnCount, lastSpawnedAt)."""
    try:
        await ctx.db(ctx.templates.count_spawn, template_id, ctx.clock())
    except Exception:
        log.exception("counting a spawn of template %s failed", template_id)
