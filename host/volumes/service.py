"""`Volumes`: the node's volumes — records and bytes in one directory (records.py), the
content API's files (files.py), tokens (tokens.py), and the servers of guests' mounts.

    <root>/<volume id>/data/      the volume's files (its `/`)
    <root>/<volume id>/staging/   uploads being written (files.py)
    <root>/.gone-<volume id>/     a destroyed volume on its way out

E2B semantics: names are `[a-zA-Z0-9_-]+` and unique, ids are UUIDs, destroying a volume
that sandboxes mount is allowed (their mounts see it gone).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

from host.private import secret_file

from .errors import VolumeNotFound
from .files import VolumeFiles
from .guestserver import GuestServer, ReplayCache
from .records import VolumeRecord, VolumeRecords, check_id
from .tokens import VolumeTokens

log = logging.getLogger(__name__)

TOKEN_KEY = ".token.key"   # in the root: every node sharing the volumes accepts the tokens


class Volumes:
    """Create, find, list and destroy volumes; open their files; mint their tokens; serve
    guests' mounts. The blocking file work runs in threads."""

    def __init__(self, root: Path, *, clock: Callable[[], float] = time.time,
                 min_free_bytes: int = 512 << 20) -> None:
        self.records = VolumeRecords(root, clock=clock)
        self.root = self.records.root
        self.tokens = VolumeTokens(secret_file(self.root / TOKEN_KEY), clock=clock)
        # guests' writes (ENOSPC) and uploads (507) stop while the disk has less free
        self.min_free_bytes = min_free_bytes
        self.replays = ReplayCache()
        self._servers: dict[str, GuestServer] = {}

    async def create(self, name: str) -> VolumeRecord:
        return await asyncio.to_thread(self.records.create, name)

    async def get(self, volume_id: str) -> VolumeRecord:
        return await asyncio.to_thread(self.records.get, volume_id)

    async def find(self, name: str) -> VolumeRecord:
        """The volume called `name` (sandboxes mount volumes by name)."""
        rec = await asyncio.to_thread(self.records.find, name)
        if rec is None:
            raise VolumeNotFound(name)
        return rec

    async def list(self) -> builtins.list[VolumeRecord]:
        return await asyncio.to_thread(self.records.list)

    async def destroy(self, volume_id: str) -> None:
        gone = await asyncio.to_thread(self.records.destroy, volume_id)
        await asyncio.to_thread(shutil.rmtree, gone, True)   # after the answer is certain

    # ---- files and tokens -------------------------------------------------------------

    def data_dir(self, volume_id: str) -> Path:
        return self.root / volume_id / "data"

    async def files(self, volume_id: str, token: str | None) -> VolumeFiles:
        """The files of `volume_id` for a content API call bearing `token` (checked
        first: no lookup tells a caller without one whether the volume exists)."""
        self.tokens.check(token, check_id(volume_id))
        rec = await self.get(volume_id)
        home = self.root / rec.volume_id
        return VolumeFiles(home / "data", home / "staging", min_free_bytes=self.min_free_bytes)

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
            rec = await asyncio.to_thread(self.records.find, name)
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
        removed = self.records.sweep()
        if removed:
            log.info("volumes: removed %d leftovers of interrupted operations", len(removed))
        return removed
