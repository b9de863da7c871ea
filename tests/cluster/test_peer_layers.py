"""Peer-to-peer layer bytes (`--p2p`: host/storage/peers.py, host/cluster/peers.py): node
B's chunk cache reads a remote layer from node A (its cached chunks, served on A's API by
a real uvicorn with the node key check) before the repository (a real moto S3 server);
damaged bytes and chunks A lacks come from the repository; the host side announces held
layers in a real Redis and writes the peers file the block server reads (0600)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
import uuid
from pathlib import Path

import boto3  # type: ignore[import-untyped]
import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware

from host.api.auth import ApiKeyMiddleware, ApiKeys, NodeKeys
from host.cluster.peers import PeerFiles, layers_route
from host.cluster.registry import Registry
from host.cluster.store import ClusterStore
from host.storage.blockserver import build_server
from host.storage.cache import CHUNK, ChunkCache
from host.storage.lsmt import LayerWriter
from host.storage.peers import PeerLayers, held_layers, held_range
from host.storage.repository import OssRepository

from .harness import Served
from .test_peers import heartbeat

KEY = "aenv_node_" + "9" * 40   # the node key: neighbours send it to each other
CLIENT_KEY = "e2b_" + "9" * 40


@pytest.fixture
def repo(moto_endpoint: str, s3_env: dict[str, str]) -> OssRepository:
    name = f"b{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=name)
    return OssRepository(bucket=name, region="us-east-1", endpoint=moto_endpoint, prefix="p2p")


@pytest.fixture
def layer(tmp_path: Path, repo: OssRepository) -> tuple[str, bytes]:
    path = tmp_path / "layer.lsmt"
    w = LayerWriter(path, 9 * CHUNK)
    w.write(0, os.urandom(8 * CHUNK))
    digest = w.finish()
    repo.put_layer(digest, path)
    return digest, path.read_bytes()


def node_a(tmp_path: Path) -> tuple[Path, Path, Starlette]:
    layers, cache = tmp_path / "a" / "layers", tmp_path / "a" / "cache"
    layers.mkdir(parents=True)
    app = Starlette(routes=[layers_route(
        lambda h, o, n: held_range(layers, cache, h, o, n, chunk_size=CHUNK))],
        middleware=[Middleware(ApiKeyMiddleware, keys=ApiKeys([CLIENT_KEY]),
                                node_keys=NodeKeys([KEY]))])
    return layers, cache, app


def test_b_reads_a_layer_from_a_before_the_repository(tmp_path, repo, layer) -> None:
    digest, raw = layer
    hexd = digest.removeprefix("sha256:")
    _, a_cache_dir, app = node_a(tmp_path)
    a_cache = ChunkCache(a_cache_dir, capacity_bytes=64 * CHUNK)
    a_blob = a_cache.blob(repo, digest)
    a_blob.pread(0, 4 * CHUNK)   # A holds chunks 0-3 only
    a_blob.close()
    assert held_layers(tmp_path / "a" / "layers", a_cache_dir) == {hexd}
    with Served(app) as served:
        peers_file = tmp_path / "peers.json"
        peers_file.write_text(json.dumps({"key": KEY, "peers": [
            {"node": "a", "address": served.url, "layers": [hexd]}]}))
        peered = PeerLayers(repo, peers_file)
        before = repo.transferred.download_bytes
        b_cache = ChunkCache(tmp_path / "b" / "cache", capacity_bytes=64 * CHUNK)
        blob = b_cache.blob(peered, digest)
        try:
            assert blob.pread(0, len(raw)) == raw
        finally:
            blob.close()
        size = len(raw)
        assert peered.peer_bytes == 4 * CHUNK   # chunks 0-3 from A
        moved = repo.transferred.download_bytes - before   # the rest, and the chunk sums
        assert size - 4 * CHUNK <= moved < size - 4 * CHUNK + 64 * 1024

        # a damaged chunk on A: B checks it against the chunk sums and takes the repository's
        damaged = a_cache_dir / hexd / "1"
        damaged.write_bytes(b"\0" * CHUNK)
        b2 = ChunkCache(tmp_path / "b2" / "cache", capacity_bytes=64 * CHUNK)
        blob = b2.blob(PeerLayers(repo, peers_file), digest)
        try:
            assert blob.pread(CHUNK, CHUNK) == raw[CHUNK:2 * CHUNK]
        finally:
            blob.close()
        # no key, or bytes A has not got: nothing served
        url = f"{served.url}/cluster/layers/{hexd}"
        assert httpx.get(url, params={"offset": 0, "length": CHUNK}).status_code == 401
        with httpx.Client(headers={"X-API-Key": KEY}) as c:
            assert c.get(url, params={"offset": 0, "length": CHUNK}).status_code == 200
            assert c.get(url, params={"offset": 6 * CHUNK, "length": CHUNK}).status_code == 404
            assert c.get(url, params={"offset": 10, "length": CHUNK}).status_code == 404
            assert c.get(url, params={"offset": 0}).status_code == 400
            assert c.get(f"{served.url}/cluster/layers/..", params={
                "offset": 0, "length": 1}).status_code == 404


@pytest.mark.asyncio(loop_scope="function")
async def test_held_layers_are_announced_and_listed_for_the_block_server(
        tmp_path, redis_url) -> None:
    store = ClusterStore.from_url(redis_url)
    registry = Registry(store)
    for node_id, port in (("a", 1), ("b", 2)):
        await heartbeat(registry, node_id, f"http://127.0.0.1:{port}")
    a, b = PeerFiles(registry, "a", KEY), PeerFiles(registry, "b", KEY)
    try:
        file_a, file_b = tmp_path / "a.json", tmp_path / "b.json"
        await a.sync_layers(lambda: {"1" * 64, "2" * 64}, file_a)
        await b.sync_layers(lambda: set(), file_b)
        doc = json.loads(file_b.read_text())
        assert doc == {"key": KEY, "peers": [{"node": "a", "address": "http://127.0.0.1:1",
                                               "layers": ["1" * 64, "2" * 64]}]}
        assert stat.S_IMODE(file_b.stat().st_mode) == 0o600   # it holds the node key
        assert json.loads(file_a.read_text())["peers"] == []   # B holds nothing
        await a.sync_layers(lambda: {"2" * 64}, file_a)         # A's cache evicted one
        await b.sync_layers(lambda: set(), file_b)
        assert json.loads(file_b.read_text())["peers"][0]["layers"] == ["2" * 64]
        await heartbeat(registry, "a", "http://127.0.0.1:1", alive_ms=1)
        await asyncio.sleep(0.05)
        await registry.sweep(retention_ms=60_000)   # A dead: off the list
        await b.sync_layers(lambda: set(), file_b)
        assert json.loads(file_b.read_text())["peers"] == []
    finally:
        await a.aclose()
        await b.aclose()
        await store.aclose()


def test_the_block_server_reads_through_its_peers_file(tmp_path, repo, moto_endpoint) -> None:
    args = argparse.Namespace(
        repo=f"oss://{repo.bucket}/p2p?endpoint={moto_endpoint}&region=us-east-1",
        cache_dir=str(tmp_path / "cache"), cache_mib=64, cache_high=0.95, cache_low=0.7,
        socket_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"),
        peers_file=str(tmp_path / "peers.json"))
    server = build_server(args)
    assert isinstance(server.repository, PeerLayers)
    assert server.stats()["repository"]["peer_bytes"] == 0   # the host's metrics see it
    args.peers_file = None
    server = build_server(args)
    assert isinstance(server.repository, OssRepository)
    assert "peer_bytes" not in server.stats()["repository"]
