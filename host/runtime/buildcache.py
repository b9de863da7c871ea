"""The template build cache: after each build step, the disk layers and guest defaults it
left, under a key chained from its parent's key and the step itself, as a manifest in
the repository (`buildstep-<key>`), so every node sharing the repository shares the cache.

    key(source) = sha256("source\\0" + what the build starts from: its layer digests and
                  guest defaults)
    key(step i) = sha256(key(step i-1) + "\\0" + type + args + files hash)

A rebuild with unchanged steps hits every key; a changed step changes its key and every
later one. Entries are small JSON documents; the layers they name are the ones the
build sealed (and pushed) into the repository.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from host.contract import BuildStep, GuestDefaults
from host.storage.errors import RepositoryError

from .manifests import ManifestStore

PREFIX = "buildstep-"


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
        try:
            d = await asyncio.to_thread(self.manifests.repo.get_manifest, PREFIX + key)
        except (RepositoryError, ValueError, OSError):
            return None
        try:
            return CacheEntry.from_json(d)
        except (KeyError, TypeError):
            return None

    async def put(self, key: str, entry: CacheEntry) -> None:
        await asyncio.to_thread(self.manifests.repo.put_manifest, PREFIX + key,
                                entry.to_json())
