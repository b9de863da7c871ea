"""The template build cache: after each build step, the disk layers and guest defaults it
left, under a key chained from its parent's key and the step itself, as a manifest in
the repository (`buildstep-<key>`), so every node sharing the repository shares the cache.

    key(source) = sha256("source\\0" + what the build starts from: its layer digests and
                  guest defaults)
    key(step i) = sha256(key(step i-1) + "\\0" + type + args + files hash)

A rebuild with unchanged steps hits every key; a changed step changes its key and every
later one. Entries are small JSON documents; the layers they name are the ones the
build sealed (and pushed) into the repository.

Entries (these, imports.py's `ocilayer-` and rebuilds.py's `buildout-`) are pure caches:
each records when it was last used (`used_at`, wall-clock, rewritten by a hit at most
hourly), and a collection drops those unused for `build_cache_ttl_s` (collect.py), so
their layers stop being roots.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from host.contract import BuildStep, GuestDefaults
from host.storage.errors import RepositoryError

from .manifests import ManifestStore

PREFIX = "buildstep-"
# documents that are caches (collect.py expires them): steps, OCI layers, whole builds
CACHE_PREFIXES = (PREFIX, "ocilayer-", "buildout-")
TOUCH_S = 3600.0  # a hit rewrites an entry's `used_at` at most this often


async def read_entry(manifests: ManifestStore, name: str) -> dict[str, Any] | None:
    """The cache document `name` (None: absent or unreadable); a hit is a use."""
    try:
        doc = await manifests.get_doc(name)  # None: absent or deleted
    except OSError:
        return None
    if doc is None:
        return None
    if time.time() - float(doc.get("used_at") or 0) > TOUCH_S:
        with contextlib.suppress(RepositoryError, OSError):  # still a hit
            await write_entry(manifests, name, doc)
    return doc


async def write_entry(manifests: ManifestStore, name: str, doc: dict[str, Any]) -> None:
    await manifests.put_doc(name, {**doc, "used_at": time.time()})


def last_used(doc: dict[str, Any]) -> float | None:
    """When a cache document was last used (None: written before entries recorded it)."""
    try:
        return float(doc["used_at"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class CacheEntry:
    layers: tuple[str, ...]
    guest: GuestDefaults

    def to_json(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "guest": asdict(self.guest)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CacheEntry:
        g = d.get("guest") or {}
        return cls(tuple(d["layers"]), GuestDefaults(user=g.get("user", "user"),
                                                     workdir=g.get("workdir", "/home/user"),
                                                     env=dict(g.get("env") or {})))


def source_key(layers: tuple[str, ...] | list[str], guest: GuestDefaults) -> str:
    doc = json.dumps({"layers": list(layers), "guest": asdict(guest)}, sort_keys=True)
    return hashlib.sha256(b"source\0" + doc.encode()).hexdigest()


def step_key(parent: str, step: BuildStep) -> str:
    doc = json.dumps({"type": step.type.upper(), "args": list(step.args),
                      "files": step.files_hash or ""}, sort_keys=True)
    return hashlib.sha256(parent.encode() + b"\0" + doc.encode()).hexdigest()


class BuildCache:
    def __init__(self, manifests: ManifestStore) -> None:
        self.manifests = manifests

    async def get(self, key: str) -> CacheEntry | None:
        if (d := await read_entry(self.manifests, PREFIX + key)) is None:
            return None
        try:
            return CacheEntry.from_json(d)
        except (KeyError, TypeError):
            return None

    async def put(self, key: str, entry: CacheEntry) -> None:
        await write_entry(self.manifests, PREFIX + key, entry.to_json())
