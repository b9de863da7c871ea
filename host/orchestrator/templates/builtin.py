"""Built-in templates (host/builtin/recipes.py), built on first use through the same
build pipeline as the template API's (builds.py), so they are ordinary templates after:
listed, tagged, their build log readable, deletable (the next use builds them again).

`ensure(ctx, ref)` runs before a create (or a build `fromTemplate`) names a template:
when `ref` is a built-in template's name and no ready build of a template by that name
exists, it prepares the recipe's archives on the host, requests and starts the build,
and waits for it. One build at a time per recipe: concurrent creates wait for the same
build. A build that is already running (or queued) is waited for, not doubled. A
template of that name that a user built takes precedence: nothing is built then.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from host.builtin.recipes import RECIPES, Recipe, RecipeError

from ..errors import OperationFailed, TemplateNotFound
from ..model import BuildRequest, BuildStart
from ..opcontext import Context
from . import builds
from . import files as template_files
from . import lookup as templates
from .names import lookup_name
from .store import BUILDING, ERROR, READY

log = logging.getLogger(__name__)

POLL_S = 0.5


def recipe_for(ref: str) -> Recipe | None:
    """The recipe `ref` names (`alias`, `aenv/alias`, `alias:default`), if any."""
    name = lookup_name(ref)
    if name is None or name.tag not in (None, "default"):
        return None
    return RECIPES.get(name.alias)


async def ensure(ctx: Context, ref: str, cache: Path) -> None:
    """Make sure the built-in template `ref` names has a ready build (no-op for any other
    name). OperationFailed (500) with the build's reason when building it fails."""
    recipe = recipe_for(ref)
    if recipe is None:
        return
    async with ctx.template_locks.hold(f"builtin:{recipe.alias}"):
        found = await templates.lookup(ctx, recipe.alias)
        if found is not None:
            tmpl, _ = found
            running = next((b for b in await ctx.db(ctx.templates.list_builds, tmpl.id)
                            if b.status == BUILDING), None)
            if running is not None:
                log.info("template %r: waiting for its running build %s", recipe.alias,
                         running.id)
                await _wait(ctx, recipe, tmpl.id, running.id)
                return
            try:
                await templates.tagged_snapshot(ctx, tmpl, None, recipe.alias)
                return
            except TemplateNotFound:
                pass                      # no ready default build: (re)build it
        await _build(ctx, recipe, cache)


async def _build(ctx: Context, recipe: Recipe, cache: Path) -> None:
    log.info("building the built-in template %r (first use; this takes minutes under "
             "TCG, its log: GET /templates/%s)", recipe.alias, recipe.alias)
    try:
        prepared = await recipe.prepare(cache, lambda m: log.info("%s: %s", recipe.alias, m))
    except RecipeError as exc:
        raise OperationFailed(f"preparing the built-in template '{recipe.alias}' "
                              f"failed: {exc}") from exc
    for archive in prepared.archives:
        if not await template_files.present(ctx, archive.files_hash):
            await template_files.adopt(ctx, archive.files_hash, archive.path)
    req = await builds.request_build(ctx, BuildRequest(
        name=recipe.alias, cpu_count=recipe.cpu_count, memory_mb=recipe.memory_mb,
        min_free_disk_mb=recipe.min_free_disk_mb))
    await builds.start_build(ctx, req.template_id, req.build_id, BuildStart(
        from_template=ctx.default_template, steps=prepared.steps,
        start_cmd=recipe.start_cmd, ready_cmd=recipe.ready_cmd))
    await _wait(ctx, recipe, req.template_id, req.build_id)


async def _wait(ctx: Context, recipe: Recipe, template_id: str, build_id: str) -> None:
    while True:
        build = await ctx.db(ctx.templates.get_build, build_id)
        if build.status == READY:
            log.info("built-in template %r is ready (build %s)", recipe.alias, build_id)
            return
        if build.status == ERROR:
            reason = (build.reason or {}).get("message", "unknown reason")
            raise OperationFailed(
                f"building the built-in template '{recipe.alias}' failed: {reason} "
                f"(log: GET /templates/{template_id}/builds/{build_id}/status); the next "
                "create that names it builds it again")
        await asyncio.sleep(POLL_S)
