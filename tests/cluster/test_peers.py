"""Peer-to-peer memory files (host/cluster/peers.py, `--p2p`): node B's `MemoryFiles`
fetches a snapshot's memory file from node A, which announced it in a real Redis and
serves it on its API (a real uvicorn with the node's key check), before the repository;
a damaged copy, a dead neighbour or a missing file fall back to the repository; nothing
outside memory/ is served, and nothing without the key.

Two MemoryFiles on two directories stand for two nodes' memory caches; the repository is
a posix_fs one (the path is the same for oss: only the sha256 in the manifest matters).
bench/bench_p2p.py measures the transfer against an oss (moto) repository."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from starlette.applications import Starlette
from starlette.middleware import Middleware

from host.api.auth import ApiKeyMiddleware, ApiKeys, NodeKeys
from host.cluster.peers import PeerFiles, memory_route
from host.cluster.registry import Registry
from host.cluster.store import ClusterStore
from host.runtime.memory import MEMORY_KEY, MemoryFiles
from host.storage.repository import PosixFsRepository

from .harness import Served
from .test_registry import fields

pytestmark = pytest.mark.asyncio(loop_scope="function")

KEY = "aenv_node_" + "7" * 40   # the node key: neighbours send it to each other
CLIENT_KEY = "e2b_" + "7" * 40
NAME = "snapA/mem/memory.diff"


async def heartbeat(registry: Registry, node_id: str, address: str, alive_ms: int = 60_000) -> None:
    """One full heartbeat of a node whose API is at `address`."""
    await registry.publish(node_id, fields(address=address, proxyAddress=address),
                           alive_ms=alive_ms, full=True, token=node_id, upserts={})


@pytest_asyncio.fixture(loop_scope="function")
async def registry(redis_url: str) -> AsyncIterator[Registry]:
    store = ClusterStore.from_url(redis_url)
    yield Registry(store)
    await store.aclose()


def node_api(memory: MemoryFiles) -> Starlette:
    """What a node's API serves to its neighbours (the route behind the key check)."""
    return Starlette(routes=[memory_route(memory.local)],
                     middleware=[Middleware(ApiKeyMiddleware, keys=ApiKeys([CLIENT_KEY]),
                                node_keys=NodeKeys([KEY]))])


def manifest(content: bytes) -> dict:
    return {"snapshot_id": "snapA", "memory": {
        "files": [NAME], "sha256": {NAME: hashlib.sha256(content).hexdigest()}}}


@pytest.fixture
def content() -> bytes:
    return bytes(range(256)) * 4096 * 3   # 3 MiB: several blocks


@pytest.fixture
def nodes(tmp_path: Path, content: bytes):
    repo = PosixFsRepository(tmp_path / "repo")
    a = MemoryFiles(tmp_path / "a" / "memory", repo, bound_mib=1024)
    b = MemoryFiles(tmp_path / "b" / "memory", repo, bound_mib=1024)
    (a.dir / NAME).parent.mkdir(parents=True)
    (a.dir / NAME).write_bytes(content)
    (a.dir / "other.bin").write_text("another file under memory/")
    (tmp_path / "a" / "state.db").write_text("outside memory/")
    with Served(node_api(a)) as served:
        yield a, b, repo, served


async def test_a_neighbour_serves_the_file_before_the_repository(registry, nodes, content):
    a, b, repo, served = nodes
    await heartbeat(registry, "nodeA", served.url)
    await heartbeat(registry, "nodeB", "http://127.0.0.1:9")
    peers_a = PeerFiles(registry, "nodeA", KEY)
    peers_b = PeerFiles(registry, "nodeB", KEY)
    try:
        a.peers, b.peers = peers_a, peers_b
        await peers_a.announce(["snapA"])
        assert not repo.has_file(MEMORY_KEY + NAME)   # only node A has it
        await b.fetch(manifest(content))
        assert (b.dir / NAME).read_bytes() == content and b.peer_hits == 1
        assert peers_b.fetched_bytes == len(content)
        assert not [p for p in (b.dir / NAME).parent.iterdir() if p.name.startswith(".")]
        # B announced it in turn, and withdraws it when its cache drops it
        assert await registry.memory_holders("snapA", ["nodeA", "nodeB"]) == ["nodeA", "nodeB"]
        await b.gc(used=set())
        assert await registry.memory_holders("snapA", ["nodeA", "nodeB"]) == ["nodeA"]
    finally:
        await peers_a.aclose()
        await peers_b.aclose()


async def test_damaged_dead_or_absent_neighbours_fall_back_to_the_repository(
        registry, nodes, content, tmp_path):
    a, b, repo, served = nodes
    good = tmp_path / "good"
    good.write_bytes(content)
    repo.put_file(MEMORY_KEY + NAME, good)
    (a.dir / NAME).write_bytes(content[:-1] + b"X")   # A's copy is damaged
    await heartbeat(registry, "nodeA", served.url)
    peers = PeerFiles(registry, "nodeB", KEY)
    b.peers = peers
    try:
        await registry.announce_memory("nodeA", ["snapA"])
        await b.fetch(manifest(content))
        assert (b.dir / NAME).read_bytes() == content and b.peer_hits == 0
        assert not [p for p in (b.dir / NAME).parent.iterdir() if p.name.startswith(".")]

        (b.dir / NAME).unlink()
        (a.dir / NAME).write_bytes(content)
        await heartbeat(registry, "nodeA", served.url, alive_ms=1)   # A stops heartbeating
        await asyncio.sleep(0.05)
        await b.fetch(manifest(content))
        assert b.peer_hits == 0 and peers.fetched_bytes == 0

        await registry.sweep(retention_ms=60_000)   # declared dead: its announcements go
        assert await registry.memory_holders("snapA", ["nodeA"]) == []
        await registry.announce_memory("nodeA", ["snapA"])   # back (use_peers does this)

        (b.dir / NAME).unlink()
        await heartbeat(registry, "nodeA", served.url)
        (a.dir / NAME).unlink()                     # announced, but gone from A
        await b.fetch(manifest(content))
        assert (b.dir / NAME).read_bytes() == content and b.peer_hits == 0
    finally:
        await peers.aclose()


async def test_only_memory_files_and_only_with_the_key(nodes):
    _, _, _, served = nodes
    with httpx.Client(base_url=served.url) as c:
        assert c.get(f"/cluster/memory/{NAME}").status_code == 401
        c.headers["X-API-Key"] = CLIENT_KEY   # a client's key: not for neighbours' routes
        assert c.get(f"/cluster/memory/{NAME}").status_code == 403
        c.headers["X-API-Key"] = KEY
        assert c.get(f"/cluster/memory/{NAME}").status_code == 200
        for bad in ("snapA", "snapA/mem", "..%2Fstate.db", "snapA/../../state.db",
                    "nope/file", ".."):
            r = c.get(f"/cluster/memory/{bad}")
            assert r.status_code == 404, (bad, r.status_code)
        assert c.get("/cluster/memory/other.bin").status_code == 200  # under memory/


async def test_an_upload_announces_its_snapshot(registry, nodes):
    a, _, repo, _ = nodes
    peers = PeerFiles(registry, "nodeA", KEY)
    a.peers = peers
    try:
        await a.upload(a.dir / "snapA" / "mem")   # a build uploads <id>/base/ like this
        assert repo.has_file(MEMORY_KEY + NAME)
        assert await registry.memory_holders("snapA", ["nodeA"]) == ["nodeA"]
        assert await registry.memory_holders("mem", ["nodeA"]) == []
    finally:
        await peers.aclose()
