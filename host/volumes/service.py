"""`Volumes`: the node's volumes — records in the state database, bytes in a directory.

    <root>/                       0700, root's only (a guest's setuid-free files below)
      <volume id>/data/           the volume's files (its `/`)
      <volume id>/staging/        uploads being written (files.py), emptied at open
      .gone-<volume id>/          a destroyed volume on its way out

A volume is recorded only once its directory exists, and its directory is renamed away
before its row goes, so a crash leaves at worst a directory without a row: `open` sweeps
those, the `.gone-*` ones and every staging directory. E2B semantics: names are
`[a-zA-Z0-9_-]+` and unique, ids are UUIDs, destroying a volume that sandboxes mount is
allowed (their mounts see it gone).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from host.private import private_dir

from .errors import InvalidVolume, VolumeNameTaken, VolumeNotFound
from .files import VolumeFiles
from .guestserver import GuestServer, ReplayCache
from .tokens import VolumeTokens

if TYPE_CHECKING:   # the orchestrator's database (host/orchestrator imports this package)
    from host.orchestrator.store import Store

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"[a-zA-Z0-9_-]+")
MAX_NAME = 250
GONE_PREFIX = ".gone-"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS volumes (
    volume_id  TEXT PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class VolumeRecord:
    volume_id: str
    name: str
    created_at: float


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME:
        raise InvalidVolume(f"Invalid volume name: '{name[:300]}' (letters, digits, '_' "
                            f"and '-', at most {MAX_NAME})")
    return name


def check_id(volume_id: str) -> str:
    try:
        return str(uuid.UUID(volume_id))
    except ValueError:
        raise InvalidVolume("Invalid volume ID") from None


class Volumes:
    """Create, find, list and destroy volumes; open their files; mint their tokens.
    The async methods run the database part on the store's thread."""

    def __init__(self, store: Store, root: Path, tokens: VolumeTokens, *,
                 clock: Callable[[], float] = time.time,
                 min_free_bytes: int = 512 << 20) -> None:
        self.store = store
        self.root = private_dir(root)
        self.tokens = tokens
        self.clock = clock
        self.min_free_bytes = min_free_bytes   # guests' writes stop (ENOSPC) under it
        self.replays = ReplayCache()
        self._servers: dict[str, GuestServer] = {}
        store.add_schema(_SCHEMA)

    # ---- records ----------------------------------------------------------------------

    def _row(self, volume_id: str) -> VolumeRecord | None:
        rows = self.store.select("SELECT * FROM volumes WHERE volume_id = ?", (volume_id,))
        return VolumeRecord(**dict(rows[0])) if rows else None

    def _by_name(self, name: str) -> VolumeRecord | None:
        rows = self.store.select("SELECT * FROM volumes WHERE name = ?", (name,))
        return VolumeRecord(**dict(rows[0])) if rows else None

    def _create(self, name: str) -> VolumeRecord:
        check_name(name)
        if self._by_name(name) is not None:
            raise VolumeNameTaken(name)
        rec = VolumeRecord(str(uuid.uuid4()), name, self.clock())
        home = self.root / rec.volume_id
        home.mkdir(mode=0o700)
        (home / "staging").mkdir(mode=0o700)
        # the volume's own root: guests write here as their users (files.py), so it is
        # open to all like E2B's (0777); the 0700 directories above keep host users out
        (home / "data").mkdir()
        os.chmod(home / "data", 0o777)
        try:
            with self.store.transaction() as db:
                if db.execute("SELECT 1 FROM volumes WHERE name = ?", (name,)).fetchone():
                    raise VolumeNameTaken(name)
                db.execute("INSERT INTO volumes VALUES (?, ?, ?)",
                           (rec.volume_id, rec.name, rec.created_at))
        except BaseException:
            shutil.rmtree(home, ignore_errors=True)
            raise
        return rec

    def _get(self, volume_id: str) -> VolumeRecord:
        rec = self._row(check_id(volume_id))
        if rec is None:
            raise VolumeNotFound(volume_id)
        return rec

    def _find(self, name: str) -> VolumeRecord:
        rec = self._by_name(name)
        if rec is None:
            raise VolumeNotFound(name)
        return rec

    def _list(self) -> list[VolumeRecord]:
        rows = self.store.select("SELECT * FROM volumes ORDER BY created_at, volume_id")
        return [VolumeRecord(**dict(r)) for r in rows]

    def _destroy(self, volume_id: str) -> Path | None:
        rec = self._get(volume_id)
        home = self.root / rec.volume_id
        gone = self.root / f"{GONE_PREFIX}{rec.volume_id}"
        if home.exists():
            home.rename(gone)
        with self.store.transaction() as db:
            db.execute("DELETE FROM volumes WHERE volume_id = ?", (rec.volume_id,))
        return gone if gone.exists() else None

    async def create(self, name: str) -> VolumeRecord:
        return await self.store.run(self._create, name)

    async def get(self, volume_id: str) -> VolumeRecord:
        return await self.store.run(self._get, volume_id)

    async def find(self, name: str) -> VolumeRecord:
        """The volume called `name` (sandboxes mount volumes by name)."""
        return await self.store.run(self._find, name)

    async def list(self) -> list[VolumeRecord]:
        return await self.store.run(self._list)

    async def destroy(self, volume_id: str) -> None:
        gone = await self.store.run(self._destroy, volume_id)
        if gone is not None:   # the bytes go after the answer is certain
            await asyncio.to_thread(shutil.rmtree, gone, True)

    # ---- files and tokens -------------------------------------------------------------

    def data_dir(self, volume_id: str) -> Path:
        return self.root / volume_id / "data"

    async def files(self, volume_id: str, token: str | None) -> VolumeFiles:
        """The files of `volume_id` for a content API call bearing `token` (checked
        first: no lookup tells a caller without one whether the volume exists)."""
        self.tokens.check(token, volume_id)
        rec = await self.get(volume_id)
        home = self.root / rec.volume_id
        return VolumeFiles(home / "data", home / "staging")

    def token(self, rec: VolumeRecord) -> str:
        return self.tokens.mint(rec.volume_id)

    # ---- guests' mounts ---------------------------------------------------------------

    async def attach(self, sandbox_id: str, names: builtins.list[str],
                     sock: socket.socket) -> None:
        """Serve the volumes `names` to `sandbox_id`'s guest on `sock` (listening in its
        network namespace), replacing what served it before. A name no volume has any
        more (destroyed meanwhile) stays unserved: the guest's calls fail (EACCES)."""
        await self.detach(sandbox_id)
        found = {}
        for name in names:
            rec = await self.store.run(self._by_name, name)
            if rec is not None:
                found[name] = self.data_dir(rec.volume_id)
        server = GuestServer(sandbox_id, found, replays=self.replays,
                             min_free_bytes=self.min_free_bytes)
        try:
            await server.start(sock)
        except BaseException:
            sock.close()
            raise
        self._servers[sandbox_id] = server

    async def detach(self, sandbox_id: str) -> None:
        """Stop serving `sandbox_id` (its run ended); idempotent."""
        server = self._servers.pop(sandbox_id, None)
        if server is not None:
            await server.aclose()

    def serving(self) -> builtins.list[str]:
        return sorted(self._servers)

    async def aclose(self) -> None:
        for sid in list(self._servers):
            await self.detach(sid)

    # ---- upkeep -----------------------------------------------------------------------

    def sweep(self) -> builtins.list[str]:
        """Remove what a crash left: destroyed volumes' bytes, directories of volumes
        never recorded, uploads never committed. Returns what was removed."""
        known = {r.volume_id for r in self._list()}
        removed = []
        for entry in os.scandir(self.root):
            path = Path(entry.path)
            if entry.name.startswith(GONE_PREFIX) or (
                    entry.is_dir(follow_symlinks=False) and entry.name not in known):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(entry.name)
                continue
            staging = path / "staging"
            for left in os.scandir(staging) if staging.is_dir() else ():
                os.unlink(left.path)
                removed.append(f"{entry.name}/staging/{left.name}")
        if removed:
            log.info("volumes: removed %d leftovers of interrupted operations", len(removed))
        return removed
