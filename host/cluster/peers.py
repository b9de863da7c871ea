"""Peer-to-peer memory files (`--p2p`, off by default): a node fetches a snapshot's memory
files from a neighbour that holds them before it goes to the repository.

Each node announces in Redis the snapshots whose memory it holds locally
(`aenv:node:<id>:memory`, a set of snapshot ids: added when it uploads or fetches them,
removed when its cache evicts them) and serves those files to its neighbours:

    GET /cluster/memory/<name>    on its API, behind the node key; 404 unless `name` is a
                                  file under its memory/ dir

A node missing a file asks the live neighbours that announced its snapshot, one after the
other, and keeps the first copy whose sha256 matches the manifest's; anything else (no
holder, a holder gone or slow, a damaged copy) falls back to the repository
(host/runtime/memory.py). Only files with a recorded sha256 travel this way, i.e. those of
remote (`oss`) repositories: a `posix_fs` repository shares its bytes by hard link, which
no neighbour beats.

The transfer is plain HTTP over the nodes' API listeners, not the `iroh` package the issue
suggests: bench/bench_p2p.py measures this path against the repository's, and the
measurements section of host/cluster/README.md says what iroh did here.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

import httpx
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from host.api.errors import error_response

from .errors import ClusterError
from .registry import Registry

log = logging.getLogger(__name__)

ROUTE = "/cluster/memory/{name:path}"
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 30.0        # between two reads: a stalled neighbour is left for the next
_BLOCK = 1 << 20


def _sync(out: BinaryIO) -> None:
    out.flush()
    os.fsync(out.fileno())


class PeerFiles:
    """`host.runtime.memory.Peers` over Redis announcements and the neighbours' APIs.
    `aclose()` when done. Announcing never fails the caller (logged: the index is a
    hint, a neighbour without the file answers 404)."""

    def __init__(self, registry: Registry, node_id: str, node_key: str, *,
                 client: httpx.AsyncClient | None = None) -> None:
        self.registry = registry
        self.node_id = node_id
        self.client = client or httpx.AsyncClient(
            headers={"X-API-Key": node_key},
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        self.fetched_bytes = 0

    async def aclose(self) -> None:
        await self.client.aclose()

    async def announce(self, owners: Iterable[str]) -> None:
        try:
            await self.registry.announce_memory(self.node_id, sorted(set(owners)))
        except ClusterError as exc:
            log.warning("announcing memory files to the cluster failed: %s", exc)

    async def withdraw(self, owners: Iterable[str]) -> None:
        try:
            await self.registry.withdraw_memory(self.node_id, sorted(set(owners)))
        except ClusterError as exc:
            log.warning("withdrawing memory files from the cluster failed: %s", exc)

    async def fetch(self, name: str, dest: Path, sha256: str) -> bool:
        owner = name.split("/", 1)[0]
        try:
            live = [n for n in await self.registry.nodes()
                    if n.alive and n.node_id != self.node_id]
            holders = set(await self.registry.memory_holders(owner, [n.node_id for n in live]))
        except ClusterError as exc:
            log.warning("finding neighbours with %s failed: %s", name, exc)
            return False
        for node in (n for n in live if n.node_id in holders):
            if await self._fetch_from(node.address, node.node_id, name, dest, sha256):
                return True
        return False

    async def _fetch_from(self, address: str, node_id: str, name: str, dest: Path,
                          sha256: str) -> bool:
        tmp = dest.with_name(f".peer-{dest.name}-{uuid.uuid4().hex[:8]}")
        digest = hashlib.sha256()
        size = 0
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            url = f"{address.rstrip('/')}/cluster/memory/{quote(name)}"
            async with self.client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    log.info("neighbour %s has no %s (%d)", node_id, name, resp.status_code)
                    return False
                out = await asyncio.to_thread(open, tmp, "wb")
                try:   # the disk in a worker thread: the event loop serves the node
                    async for block in resp.aiter_bytes(_BLOCK):
                        digest.update(block)
                        await asyncio.to_thread(out.write, block)
                        size += len(block)
                    await asyncio.to_thread(_sync, out)
                finally:
                    out.close()
            if digest.hexdigest() != sha256:
                log.warning("neighbour %s sent a damaged %s (sha256 %s, want %s): using "
                            "the repository", node_id, name, digest.hexdigest(), sha256)
                return False
            os.replace(tmp, dest)
            self.fetched_bytes += size
            return True
        except (httpx.HTTPError, OSError) as exc:
            log.info("fetching %s from neighbour %s failed: %s", name, node_id, exc)
            return False
        finally:
            tmp.unlink(missing_ok=True)


class _File(FileResponse):
    chunk_size = _BLOCK   # starlette's 64 KiB reads cost a worker-thread hop each


def memory_route(memory_file: Callable[[str], Path | None]) -> Route:
    """The node API's route serving memory files to neighbours (`memory_file`: the
    runtime's lookup, None for anything it does not hold under memory/)."""

    async def serve(request: Request) -> Response:
        path = memory_file(str(request.path_params["name"]))
        if path is None:
            return error_response(404, "no such memory file on this node")
        return _File(path, media_type="application/octet-stream")

    return Route(ROUTE, serve, methods=["GET"])
