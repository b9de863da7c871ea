"""The template catalog: built templates and named snapshots that every node of a cluster
can start sandboxes from.

A node in a cluster (`Context.handoff`) keeps, in the shared repository next to the
snapshots themselves (`runtime.put_document`):

    template-<id>       a template as its home node (the one that built it) holds it: the
                        record, its aliases, its tags and the ready builds and snapshot
                        records those tags point at
    alias-<alias>       {"templateId": ...}: what a name refers to
    named-<quoted id>   a named snapshot's record (Sandbox.create_snapshot)

rewritten whenever a build turns ready or tags move, withdrawn when deleted there.

A node asked for a template or snapshot it does not hold imports it: the records enter
its store marked imported (builds: spec `imported`; snapshot records: spec `foreign`), and
sandboxes start from them as from its own, their memory and layers fetched from the
repository on demand (the runtime's cache). An imported template is read again at each
lookup (one small document), so tags moved on the home node are followed and a template
deleted there is dropped here. This node never deletes a foreign snapshot's files
(snapshots.collect_snapshots): they are its home node's.

Failures to publish are logged, never raised: the build or snapshot succeeded and is
usable on its own node; the next change publishes again.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any
from urllib.parse import quote

from ..opcontext import Context
from ..store import SnapshotRecord
from .store import IMPORTED, READY, BuildRecord, TagRecord, TemplateRecord, all_imported

log = logging.getLogger(__name__)

VERSION = 1
FOREIGN = "foreign"      # snapshot spec: another node's; never delete its files here


def _name(kind: str, key: str) -> str:
    return f"{kind}-{quote(key, safe='')}"


def is_foreign(snap: SnapshotRecord) -> bool:
    return bool(snap.spec.get(FOREIGN))


# ---- the home node publishes ---------------------------------------------------------

async def publish_template(ctx: Context, template_id: str) -> None:
    """After a build turned ready or tags moved: the template's document and its aliases.
    Only its home node publishes (a node holding an imported copy does not)."""
    if not ctx.handoff:
        return
    try:
        doc = await ctx.db(_template_document, ctx, template_id)
        if doc is None:
            return
        await ctx.runtime.put_document(_name("template", template_id), doc)
        for alias in doc["template"]["aliases"]:
            await ctx.runtime.put_document(_name("alias", alias), {"templateId": template_id})
    except Exception:
        log.exception("template %s: publishing it to the cluster's catalog failed; it can "
                      "start sandboxes only on this node", template_id)


def _template_document(ctx: Context, template_id: str) -> dict[str, Any] | None:
    """Runs on the store's thread. None for a template this node imported."""
    ts = ctx.templates
    builds = ts.list_builds(template_id)
    if not builds or all_imported(builds):
        return None
    tmpl = ts.get_template(template_id)
    tags = ts.tags(template_id)
    tagged = {t.build_id for t in tags}
    ready = [b for b in builds if b.id in tagged and b.status == READY and b.snapshot_id]
    snaps = []
    for b in ready:
        snap = ctx.store.get_snapshot(str(b.snapshot_id))
        snaps.append(dataclasses.asdict(dataclasses.replace(
            snap, spec={k: v for k, v in snap.spec.items() if k != FOREIGN})))
    return {"version": VERSION,
            "template": {**dataclasses.asdict(tmpl), "spawn_count": 0,
                         "last_spawned_at": None},
            "builds": [dataclasses.asdict(b) for b in ready],
            "tags": [dataclasses.asdict(t) for t in tags if t.build_id in {b.id for b in ready}],
            "snapshots": snaps}


async def withdraw_template(ctx: Context, tmpl: TemplateRecord, builds: list[BuildRecord]) -> None:
    """After its home node deleted it. Imported copies elsewhere drop it at their next
    lookup."""
    if not ctx.handoff or not builds or all_imported(builds):
        return
    try:
        await ctx.runtime.delete_document(_name("template", tmpl.id))
        for alias in tmpl.aliases:
            pointed = await ctx.runtime.get_document(_name("alias", alias))
            if pointed is not None and pointed.get("templateId") == tmpl.id:
                await ctx.runtime.delete_document(_name("alias", alias))
    except Exception:
        log.exception("template %s: withdrawing it from the cluster's catalog failed",
                      tmpl.id)


async def publish_named(ctx: Context, snap: SnapshotRecord) -> None:
    if not ctx.handoff or is_foreign(snap):
        return
    try:
        await ctx.runtime.put_document(_name("named", snap.id),
                                       {"version": VERSION, "snapshot": dataclasses.asdict(snap)})
    except Exception:
        log.exception("snapshot %s: publishing it to the cluster's catalog failed; it can "
                      "start sandboxes only on this node", snap.id)


async def withdraw_named(ctx: Context, snap: SnapshotRecord) -> None:
    if not ctx.handoff or is_foreign(snap):
        return
    try:
        await ctx.runtime.delete_document(_name("named", snap.id))
    except Exception:
        log.exception("snapshot %s: withdrawing it from the cluster's catalog failed", snap.id)


# ---- other nodes import --------------------------------------------------------------

async def find_template(ctx: Context, ref: str) -> tuple[TemplateRecord | None, list[str]]:
    """The template `ref` (an id or an alias) names: this node's own, else (in a cluster)
    the catalog's, imported or refreshed here; None when neither has it. Also the ids of
    the snapshots the refresh released (builds no tag points at any more, or the whole
    copy of a template deleted on its home node), for the caller to orphan."""
    local = await ctx.db(ctx.templates.find_template, ref)
    if not ctx.handoff:
        return local, []
    if local is not None and not await ctx.db(ctx.templates.is_imported, local.id):
        return local, []
    doc = await _template_doc(ctx, ref)
    if doc is None or doc.get("version") != VERSION:
        if local is None:
            return None, []
        builds = await ctx.db(ctx.templates.delete_template, local.id)   # deleted at home
        log.info("template %s: dropped here (deleted on its home node)", local.id)
        return None, [b.snapshot_id for b in builds if b.snapshot_id]
    return await _import(ctx, doc)


async def _template_doc(ctx: Context, ref: str) -> dict[str, Any] | None:
    doc = await ctx.runtime.get_document(_name("template", ref))
    if doc is not None:
        return doc
    pointed = await ctx.runtime.get_document(_name("alias", ref))
    if pointed is None or not pointed.get("templateId"):
        return None
    return await ctx.runtime.get_document(_name("template", str(pointed["templateId"])))


async def _import(ctx: Context, doc: dict[str, Any]) -> tuple[TemplateRecord | None, list[str]]:
    tmpl = TemplateRecord(**{**doc["template"], "aliases": tuple(doc["template"]["aliases"])})
    builds = [BuildRecord(**{**b, "tags": tuple(b["tags"]),
                             "spec": {**b["spec"], IMPORTED: True}}) for b in doc["builds"]]
    tags = [TagRecord(**t) for t in doc["tags"]]
    before = await ctx.db(ctx.templates.list_builds, tmpl.id)
    for s in doc["snapshots"]:
        snap = SnapshotRecord(**{**s, "spec": {**s["spec"], FOREIGN: True}})
        await ctx.db(ctx.store.insert_snapshot, snap)
    released: list[str] = []
    if await ctx.db(ctx.templates.import_template, tmpl, builds, tags):
        log.info("template %s (%s): imported from the cluster's catalog", tmpl.id,
                 ", ".join(tmpl.aliases) or "no alias")
        kept = {b.snapshot_id for b in builds}
        released = [b.snapshot_id for b in before if b.snapshot_id and b.snapshot_id not in kept]
    return await ctx.db(ctx.templates.find_template, tmpl.id), released


async def find_named(ctx: Context, snapshot_id: str) -> SnapshotRecord | None:
    """A named snapshot of another node, from the catalog (imported here), or None."""
    if not ctx.handoff:
        return None
    doc = await ctx.runtime.get_document(_name("named", snapshot_id))
    if doc is None or doc.get("version") != VERSION:
        return None
    s = doc["snapshot"]
    snap = SnapshotRecord(**{**s, "spec": {**s["spec"], FOREIGN: True}})
    await ctx.db(ctx.store.insert_snapshot, snap)
    log.info("snapshot %s: imported from the cluster's catalog", snap.id)
    return snap


async def still_named(ctx: Context, snap: SnapshotRecord) -> bool:
    """For an imported named snapshot: whether its home node still has it. (Its record
    stays here: sandboxes of this node may have started from it.)"""
    if snap.kind != "named" or not is_foreign(snap) or not ctx.handoff:
        return True
    return await ctx.runtime.get_document(_name("named", snap.id)) is not None
