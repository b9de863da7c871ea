"""Snapshot manifests in the repository: the commit point of every snapshot.

A snapshot is usable once `snapshot-<id>` exists in the repository; everything it names
(frozen base memory, memory diff chain, device state, sealed disk layers) was made durable
before. A crash before the manifest write leaves earlier snapshots untouched.
"""

from __future__ import annotations

import asyncio
from typing import Any

from host.storage.errors import RepositoryError
from host.storage.repository import open_repository

from .errors import SnapshotNotFoundError

PREFIX = "snapshot-"
VERSION = 2  # 2: memory paths relative to memory/, plus the `files` to fetch


class ManifestStore:
    def __init__(self, repository_spec: str) -> None:
        self.repo = open_repository(repository_spec)

    async def put(self, snapshot_id: str, manifest: dict[str, Any]) -> None:
        await self.put_doc(PREFIX + snapshot_id, manifest)

    async def get(self, snapshot_id: str) -> dict[str, Any]:
        m = await self.get_doc(PREFIX + snapshot_id)
        if m is None:
            raise SnapshotNotFoundError(f"snapshot {snapshot_id} not found or deleted")
        return m

    async def delete(self, snapshot_id: str) -> None:
        await self.delete_doc(PREFIX + snapshot_id)

    # --- any JSON document of the repository's manifest space (snapshots, documents) ---

    async def put_doc(self, name: str, doc: dict[str, Any]) -> None:
        await asyncio.to_thread(self.repo.put_manifest, name, doc)

    async def get_doc(self, name: str) -> dict[str, Any] | None:
        """The document `name`; None when it is absent or deleted."""
        try:
            doc = await asyncio.to_thread(self.repo.get_manifest, name)
        except (RepositoryError, ValueError):
            return None
        return None if doc.get("deleted") else doc

    async def delete_doc(self, name: str) -> None:
        await asyncio.to_thread(self.repo.delete_manifest, name)

    async def all(self) -> dict[str, dict[str, Any]]:
        """Every snapshot manifest, by snapshot id."""
        docs = await self.documents(PREFIX)
        return {name[len(PREFIX):]: doc for name, doc in docs.items()}

    async def documents(self, prefix: str = "", *,
                        purge: bool = False) -> dict[str, dict[str, Any]]:
        """Every document of the manifest space whose name starts with `prefix`, by name
        (deleted ones and unreadable ones left out). `purge`: the tombstones older
        versions wrote for a delete (`{"deleted": true}`) are removed."""
        names = await asyncio.to_thread(self.repo.list_manifests)
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            if not name.startswith(prefix):
                continue
            try:
                m = await asyncio.to_thread(self.repo.get_manifest, name)
            except (RepositoryError, ValueError):
                continue
            if not m.get("deleted"):
                out[name] = m
            elif purge:
                await self.delete_doc(name)
        return out
