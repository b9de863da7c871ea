"""Collection of what this node's runtime holds and nothing needs any more.

What is needed (the roots): every document in the repository's manifest space (snapshot
manifests, build-step and OCI-import cache entries, handoffs, catalog entries) and every
layer or memory dir they name; the base image's layers (`layers.json`); what starts are
about to stack (`NodeParts.layer_pins`) or restore (memory pins); what live, kept, warm and
building VMs map. Everything else goes: sealed layers through the block server (which also
keeps what its stacks hold, and anything younger than `min_age_s`: a snapshot's layer is
sealed before its manifest names it), memory dirs locally and, where this node owns the
repository (`RuntimeConfig.owns_repository`), the repository's copies of both.

Deleting a snapshot (`snapshots.delete`) already frees what only it used; a collection
catches what no delete reached: snapshots whose commit failed after their files were
written, a crash between a manifest's delete and its files', layers of killed sandboxes'
disks that were never in a manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from host.storage.collect import Swept, layer_bytes
from host.storage.repository import PosixFsRepository

from . import holds
from .buildcache import CACHE_PREFIXES, last_used, write_entry
from .memory import MEMORY_KEY, tree_bytes
from .parts import Claims, NodeParts

log = logging.getLogger(__name__)


def named_layers(doc: Any) -> Iterator[str]:
    """Every layer digest a document names: the values of `layers` (lists) and `layer`
    keys at any depth (snapshot manifests' `disk.layers`, build-step and OCI-import
    entries' `layers`, the blank layer's `layer`)."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "layers" and isinstance(value, list):
                yield from (v for v in value if isinstance(v, str))
            elif key == "layer" and isinstance(value, str):
                yield value
            else:
                yield from named_layers(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from named_layers(item)


def _image_cache_layers(cache_file: Path) -> set[str]:
    try:
        return {str(v) for v in json.loads(cache_file.read_text()).values()}
    except (OSError, ValueError, AttributeError):
        return set()


async def collect(p: NodeParts, *, dry_run: bool = False,
                  min_age_s: float = 600.0) -> dict[str, Any]:
    """Remove (`dry_run`: count) what nothing needs; returns per kind {files, bytes,
    digests}: `layers`, `repository_layers`, `memory`, `repository_memory`, and
    `build_cache` (entries expired: no bytes of their own, their layers are counted in
    `layers`); and `waiting_layers`, unreferenced layers kept until other nodes'
    holdings show them unused (holds.py)."""
    t0 = time.perf_counter()
    owns = p.config.owns_repository
    if not owns:  # a shared repository (holds.py): ours first, the others' below
        await holds.publish(p)
    docs = await p.manifests.documents(purge=not dry_run)
    now = time.time()
    peers, gone = ({}, {}) if owns else holds.others(p, docs, now)
    expired = await _expire_cache_entries(p, docs, dry_run=dry_run)
    # pins are read after the documents: a start that read a manifest deleted meanwhile
    # pinned its layers before this listing ended (starts.py), with no await between
    keep = {d for doc in docs.values() for d in named_layers(doc)}
    keep |= await asyncio.to_thread(_image_cache_layers, p.config.state_dir / "layers.json")
    keep |= set(p.layer_pins)
    waiting: set[str] = set()
    lost, adopted = holds.orphans(p, gone, peers, keep) if not owns else (Claims(), {})
    if not owns:  # what other nodes may still need waits a phase (not counted as collectable)
        probe = await p.block.client.collect(sorted(keep), min_age_s=min_age_s, dry_run=True)
        found = [d for d in probe["local"]["digests"] if "." not in d]  # not partials
        candidates = sorted(set(found) | lost.layers)
        waiting = set(candidates) - await asyncio.to_thread(
            holds.ready, p, candidates, peers, now, remember=not dry_run)
        keep |= waiting
    layers = await p.block.client.collect(sorted(keep), min_age_s=min_age_s,
                                          dry_run=dry_run,
                                          repository="sweep" if owns else "own")
    used, memory = await p.gc_memory(dry_run=dry_run)
    # the repository's memory this node uploaded; on its own posix_fs one, also whatever
    # else is there (uploaded before uploads were recorded)
    remote_memory = await p.memory.gc_remote(used, min_age_s=min_age_s, dry_run=dry_run)
    if owns and isinstance(p.memory.repo, PosixFsRepository):
        remote_memory.merge(await asyncio.to_thread(
            _sweep_repository_memory, p.memory.repo, used, min_age_s, dry_run))
    if lost.layers or lost.memory or adopted:  # what only this node answers for now
        gone_layers, gone_memory = await holds.delete_orphans(
            p, lost, lost.layers - waiting, used, adopted, dry_run=dry_run)
        gone_layers.merge(Swept(**layers["repository"]))
        layers["repository"] = gone_layers.to_dict()
        remote_memory.merge(gone_memory)
    out: dict[str, Any] = {
        "layers": layers["local"], "repository_layers": layers["repository"],
        "memory": memory.to_dict(), "repository_memory": remote_memory.to_dict(),
        "build_cache": {"files": len(expired), "bytes": 0, "digests": expired},
        "waiting_layers": len(waiting)}
    if any(isinstance(v, dict) and v["files"] for v in out.values()):
        log.info("storage %s: %s", "collectable" if dry_run else "collected",
                 ", ".join(f"{k} {v['files']} ({v['bytes']} bytes)" for k, v in out.items()
                         if isinstance(v, dict)))
    if not owns and not dry_run:  # what it made and deleted leaves its holdings now
        await holds.publish(p)
    out["held"] = await asyncio.to_thread(held_bytes, p)
    out["dry_run"] = dry_run
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


async def _expire_cache_entries(p: NodeParts, docs: dict[str, dict[str, Any]], *,
                                dry_run: bool) -> list[str]:
    """Drop from `docs` (and, unless `dry_run`, from the repository) the build-step and
    OCI-import cache entries unused for `build_cache_ttl_s`, so the layers only they name
    are collected below; none while this node builds (a build may have read an entry and
    not yet stacked its layers). An entry written before entries recorded their use is
    stamped now: it gets one whole period."""
    if p.building:
        return []
    cutoff = time.time() - p.config.build_cache_ttl_s
    expired = []
    for name, doc in list(docs.items()):
        if not name.startswith(CACHE_PREFIXES):
            continue
        used = last_used(doc)
        if used is None:
            if not dry_run:
                await write_entry(p.manifests, name, doc)
        elif used < cutoff:
            expired.append(name)
            del docs[name]
            if not dry_run:
                await p.manifests.delete_doc(name)
    return expired


def held_bytes(p: NodeParts) -> dict[str, int]:
    """Bytes on disk by kind: sealed layers and memory dirs of the node, and of its
    repository where it is a posix_fs one (hard links of the node's files count in both)."""
    held = {"layers": layer_bytes(p.config.layers_dir),
            "memory": p.memory.used_bytes()}
    repo = p.memory.repo
    if isinstance(repo, PosixFsRepository):
        held["repository_layers"] = layer_bytes(repo.layers_dir)
        held["repository_memory"] = tree_bytes(_repository_memory(repo))
    return held


def _repository_memory(repo: PosixFsRepository) -> Path:
    """Where a posix_fs repository keeps memory files: `files/memory/<snapshot id>/`."""
    return repo.root / "files" / MEMORY_KEY.rstrip("/")


def _sweep_repository_memory(repo: PosixFsRepository, used: set[str], min_age_s: float,
                             dry_run: bool) -> Swept:
    """The repository's memory dirs (`files/memory/<snapshot id>/`) no manifest, live VM
    or start uses, older than `min_age_s` (a pause uploads its memory before its
    manifest names it)."""
    out = Swept()
    root = _repository_memory(repo)
    if not root.is_dir():
        return out
    cutoff = time.time() - min_age_s
    for d in root.iterdir():
        with contextlib.suppress(OSError):
            if d.name in used or d.stat().st_mtime > cutoff:
                continue
            out.files += 1
            out.digests.append(d.name)
            out.bytes += tree_bytes(d, unshared=True)
            if not dry_run:
                shutil.rmtree(d, ignore_errors=True)
    return out
