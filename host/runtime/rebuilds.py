"""Unchanged rebuilds: a build whose every input matches a ready build reuses it without
booting a VM (E2B's builder skips the steps it finds cached; RL pipelines rebuild
thousands of task templates whose recipes rarely change).

The inputs are everything that decides a template's disk and memory: the last step's
build-cache key (chained from the source's layers and guest defaults, each step's type,
arguments and files' hash), the start and ready commands (the image's own start command
when the build sets none), the machine (cpu, memory, disk, image), `min_free_disk_mb`,
the kernel, its command line and the node's network mode. Their hash names a cache
document `buildout-<key>` holding the snapshot id of the build that made them.

A reuse commits a manifest of its own under the new build's snapshot id, a copy of the
ready one's that `depends_on` it: its memory and layers stay while either manifest
exists (snapshots.delete, collect.py), so deleting the old build (a rebuild moves the
template's tag) loses nothing. It is taken only if the ready build's memory can be
restored here (same VMM identity and configuration digest as a sandbox of it would
compute), and it is never taken with `skip_cache` (BuildSpec.force).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from typing import Any

from host.contract import BuildSpec, SnapshotRef

from .buildcache import read_entry, write_entry
from .errors import SnapshotNotFoundError
from .parts import NodeParts

PREFIX = "buildout-"


def output_key(spec: BuildSpec, last_key: str, *, kernel: str, cmdline: str,
               image_start: str | None, network_mode: str) -> str:
    doc = json.dumps({
        "steps": last_key, "start": spec.start_cmd or image_start, "ready": spec.ready_cmd,
        "machine": asdict(spec.machine), "min_free_disk_mb": spec.min_free_disk_mb,
        "kernel": kernel, "cmdline": cmdline, "network": network_mode,
    }, sort_keys=True)
    return hashlib.sha256(b"buildout\0" + doc.encode()).hexdigest()


async def remember(p: NodeParts, key: str, snapshot_id: str) -> None:
    """`snapshot_id` is the ready build of inputs `key`."""
    await write_entry(p.manifests, PREFIX + key, {"snapshot_id": snapshot_id})


async def ready_build(p: NodeParts, key: str) -> dict[str, Any] | None:
    """The manifest of a ready build of inputs `key` whose memory restores on this node."""
    doc = await read_entry(p.manifests, PREFIX + key)
    if doc is None or not isinstance(doc.get("snapshot_id"), str):
        return None
    try:
        m = await p.manifests.get(doc["snapshot_id"])
    except (SnapshotNotFoundError, OSError):
        return None
    if m.get("kind") != "template" or not m.get("config_sha256"):
        return None
    current = await p.machines.identity()
    if current.differences(m.get("vmm") or {}):
        return None  # built under another QEMU, accelerator or CPU model
    if p.machines.restore_digest(m) != m["config_sha256"]:
        return None  # another VM configuration (flags, balloon, ...) since
    return m


async def reuse(p: NodeParts, spec: BuildSpec, ready: dict[str, Any],
                timings: dict[str, float]) -> SnapshotRef | None:
    """Commit `spec.snapshot_id` as a copy of the ready build `ready`; None if that build
    was deleted meanwhile (the caller builds for real)."""
    m = {**ready, "snapshot_id": spec.snapshot_id, "created_at": time.time(),
         "parent_id": spec.from_snapshot,
         "depends_on": sorted({*ready.get("depends_on", ()), ready["snapshot_id"],
                               spec.snapshot_id}),
         "build": {**(ready.get("build") or {}), "cached_steps": len(spec.steps),
                   "reused": ready["snapshot_id"]},
         "timings": {k: round(v, 3) for k, v in timings.items()}}
    await p.manifests.put(spec.snapshot_id, m)
    try:  # a delete of the ready build that ran before our put may have taken its memory
        await p.manifests.get(ready["snapshot_id"])
    except SnapshotNotFoundError:
        await p.manifests.delete(spec.snapshot_id)
        return None
    p.last_timings = timings
    return SnapshotRef(spec.snapshot_id, spec.machine, m["created_at"], spec.from_snapshot, m)
