"""Peer-to-peer artifacts (`--p2p`, off by default): a node fetches a snapshot's memory
files, and its block server the bytes of remote layers, from a neighbour that holds them
before it goes to the repository.

Each node announces in Redis what it holds locally: the snapshots whose memory it has
(`aenv:node:<id>:memory`: added when it uploads or fetches them, removed when its cache
evicts them) and the layers it has bytes of (`aenv:node:<id>:layers`: its sealed layers
and chunk-cache entries, rewritten every 2 s), and serves them to its neighbours on its
API, behind the node key:

    GET /cluster/memory/<name>                 404 unless `name` is a file under memory/
    GET /cluster/layers/<hex>?offset=&length=  from its sealed layer file or the one cached
                                               chunk those bytes are; 404 otherwise

Layer bytes are read by the block server, another process: every 2 s the node writes the
live neighbours holding layers, and the node key, into a 0600 peers file it reads
(host/storage/peers.py, which checks a neighbour's bytes against the layer's chunk sums).

A node missing a memory file asks the live neighbours that announced its snapshot, one
after the other, and keeps the first copy whose sha256 matches the manifest's; anything
else (no holder, a holder gone or slow, a damaged copy) falls back to the repository
(host/runtime/memory.py). Only files with a recorded sha256 travel this way, i.e. those of
remote (`oss`) repositories: a `posix_fs` repository shares its bytes by hard link, which
no neighbour beats (and its layers are read in place, never through the chunk cache).

The transfer is plain HTTP over the nodes' API listeners, not the `iroh` package the issue
suggests: bench/bench_p2p.py measures this path against the repository's, and the
measurements section of host/cluster/README.md says what iroh did here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import httpx
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from host.api.errors import error_response
from host.private import write_private
from host.tasks import cancel_and_wait, run_every

from .errors import ClusterError
from .registry import Registry

log = logging.getLogger(__name__)

ROUTE = "/cluster/memory/{name:path}"
LAYERS_ROUTE = "/cluster/layers/{hex}"
LAYERS_INTERVAL_S = 2.0
MAX_RANGE = 16 << 20       # one block server chunk is 1 MiB
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
        self.key = node_key
        self._layers_task: asyncio.Task[None] | None = None
        self._written: dict[str, Any] | None = None
        self.client = client or httpx.AsyncClient(
            headers={"X-API-Key": node_key},
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        self.fetched_bytes = 0

    async def aclose(self) -> None:
        await cancel_and_wait(self._layers_task)
        await self.client.aclose()

    # --- layers: announced for the neighbours' block servers, theirs listed for ours ---

    def serve_layers(self, held: Callable[[], set[str]], peers_file: Path, *,
                     interval_s: float = LAYERS_INTERVAL_S) -> None:
        """Every `interval_s`: announce the layers this node holds bytes of (`held`,
        blocking), and write the live neighbours holding layers into `peers_file`, which
        this node's block server reads (host/storage/peers.py). An owned task."""
        self._layers_task = asyncio.create_task(run_every(
            interval_s, lambda: self.sync_layers(held, peers_file), log=log,
            failed="announcing layers to the cluster failed"))

    async def sync_layers(self, held: Callable[[], set[str]], peers_file: Path) -> None:
        await self.registry.set_layers(self.node_id, sorted(await asyncio.to_thread(held)))
        live = await self.registry.live_nodes(exclude=self.node_id)
        layers = await self.registry.layers_of([n.node_id for n in live])
        doc = {"key": self.key, "peers": [
            {"node": n.node_id, "address": n.address, "layers": sorted(layers[n.node_id])}
            for n in live if layers[n.node_id]]}
        if doc != self._written:   # the block server re-reads it when it changes
            # 0600: it holds the node key
            await asyncio.to_thread(write_private, peers_file, json.dumps(doc).encode())
            self._written = doc

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
            live = await self.registry.live_nodes(exclude=self.node_id)
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


def layers_route(layer_range: Callable[[str, int, int], bytes | None]) -> Route:
    """The node API's route serving layer bytes to the neighbours' block servers
    (`layer_range`: the runtime's lookup, blocking; None when this node has not got
    them)."""

    async def serve(request: Request) -> Response:
        try:
            offset = int(request.query_params["offset"])
            length = int(request.query_params["length"])
        except (KeyError, ValueError):
            return error_response(400, "offset and length (integers) are required")
        if offset < 0 or not 0 < length <= MAX_RANGE:
            return error_response(400, f"offset >= 0 and 0 < length <= {MAX_RANGE}")
        data = await asyncio.to_thread(layer_range, str(request.path_params["hex"]), offset,
                                       length)
        if data is None:
            return error_response(404, "this node has not got those layer bytes")
        return Response(data, media_type="application/octet-stream")

    return Route(LAYERS_ROUTE, serve, methods=["GET"])


def memory_route(memory_file: Callable[[str], Path | None]) -> Route:
    """The node API's route serving memory files to neighbours (`memory_file`: the
    runtime's lookup, None for anything it does not hold under memory/)."""

    async def serve(request: Request) -> Response:
        path = memory_file(str(request.path_params["name"]))
        if path is None:
            return error_response(404, "no such memory file on this node")
        return _File(path, media_type="application/octet-stream")

    return Route(ROUTE, serve, methods=["GET"])
