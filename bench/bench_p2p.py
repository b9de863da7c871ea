"""Peer-to-peer memory files (`--p2p`, host/cluster/peers.py) against the repository path.

Node A holds a snapshot's memory file and a layer (it uploaded both to an `oss`
repository: a real moto S3 server process). Node B needs them, in the same run:
  * memory file from the repository: `MemoryFiles.fetch` as without --p2p (S3 GET, sha256
    checked); from A: the same call with `PeerFiles` (Redis lookup of who announced it, an
    HTTP GET from A's API route served by uvicorn, sha256 checked, atomic rename);
  * layer, read whole through B's chunk cache (1 MiB chunks, each checked against the
    layer's chunk sums): from the repository, or with `PeerLayers` (what the block server
    does with --p2p: each chunk from A's API route first);
  * floor: a local `shutil.copyfile` of the file (what no transport can beat here).
Everything is on loopback on one machine, so the numbers compare the transports' own
costs (S3 server and client vs a plain HTTP stream), not networks. Prints medians and
ratios; samples go to --json.

    .venv/bin/python bench/bench_p2p.py [--mib 64 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import boto3

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from starlette.applications import Starlette
from starlette.middleware import Middleware

from host.api.auth import ApiKeyMiddleware, ApiKeys
from host.cluster.peers import PeerFiles, layers_route, memory_route
from host.cluster.registry import Registry
from host.cluster.store import ClusterStore
from host.runtime.memory import MemoryFiles
from host.storage.cache import CHUNK, ChunkCache
from host.storage.lsmt import LayerWriter
from host.storage.peers import PeerLayers, held_range
from host.storage.repository import OssRepository
from tests.cluster.harness import RedisServer, Served
from tests.cluster.test_peers import heartbeat
from tests.conftest import moto_server

KEY = "e2b_" + "b" * 40


def write_random(path: Path, mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.writelines(os.urandom(1 << 20) for _ in range(mib))


async def measure(root: Path, repo: OssRepository, registry: Registry, mib: int,
                  runs: int) -> dict[str, list[float]]:
    snap = f"snap{mib}"
    a = MemoryFiles(root / "a", repo, bound_mib=1 << 20)
    write_random(a.dir / snap / "mem" / "memory.bin", mib)
    sums = await a.upload(a.dir / snap)
    m = {"snapshot_id": snap, "memory": {"files": sorted(sums), "sha256": sums}}
    out: dict[str, list[float]] = {"repository": [], "peer": [], "copy": []}
    with Served(Starlette(routes=[memory_route(a.local)],
                          middleware=[Middleware(ApiKeyMiddleware, keys=ApiKeys([KEY]))])) as srv:
        for node_id, url in (("bench-a", srv.url), ("bench-b", "http://127.0.0.1:9")):
            await heartbeat(registry, node_id, url, alive_ms=600_000)
        await registry.announce_memory("bench-a", [snap])
        peers = PeerFiles(registry, "bench-b", KEY)
        try:
            for _ in range(runs):
                for kind in ("repository", "peer", "copy"):
                    b = MemoryFiles(root / f"b-{kind}", repo, bound_mib=1 << 20)
                    shutil.rmtree(b.dir, ignore_errors=True)
                    b.dir.mkdir(parents=True)
                    t0 = time.perf_counter()
                    if kind == "copy":
                        dst = b.dir / snap / "mem" / "memory.bin"
                        dst.parent.mkdir(parents=True)
                        await asyncio.to_thread(shutil.copyfile,
                                                a.dir / snap / "mem" / "memory.bin", dst)
                    else:
                        b.peers = peers if kind == "peer" else None
                        await b.fetch(m)
                        if kind == "peer" and b.peer_hits != 1:
                            raise RuntimeError("the peer fetch fell back to the repository")
                    out[kind].append(time.perf_counter() - t0)
        finally:
            await peers.aclose()
    out.update(await asyncio.to_thread(measure_layer, root, repo, mib, runs))
    return out


def measure_layer(root: Path, repo: OssRepository, mib: int,
                  runs: int) -> dict[str, list[float]]:
    layers = root / "a-layers"
    layers.mkdir(parents=True)
    w = LayerWriter(layers / "tmp.lsmt", (mib + 1) << 20)
    w.write(0, os.urandom(mib << 20))
    digest = w.finish()
    (layers / "tmp.lsmt").rename(layers / f"{digest.removeprefix('sha256:')}.lsmt")
    repo.put_layer(digest, layers / f"{digest.removeprefix('sha256:')}.lsmt")
    app = Starlette(routes=[layers_route(
        lambda h, o, n: held_range(layers, None, h, o, n, chunk_size=CHUNK))],
        middleware=[Middleware(ApiKeyMiddleware, keys=ApiKeys([KEY]))])
    out: dict[str, list[float]] = {"layer repository": [], "layer peer": []}
    with Served(app) as srv:
        peers_file = root / "peers.json"
        peers_file.write_text(json.dumps({"key": KEY, "peers": [
            {"node": "bench-a", "address": srv.url,
             "layers": [digest.removeprefix("sha256:")]}]}))
        for i in range(runs):
            for kind, source in (("layer repository", repo),
                                 ("layer peer", PeerLayers(repo, peers_file))):
                cache = ChunkCache(root / f"cache-{kind[6:]}-{i}", capacity_bytes=4 << 30)
                blob = cache.blob(source, digest)
                t0 = time.perf_counter()
                try:
                    blob.pread(0, blob.size)
                finally:
                    blob.close()
                out[kind].append(time.perf_counter() - t0)
                if kind == "layer peer" and source.peer_bytes < blob.size - CHUNK:
                    raise RuntimeError("the layer was not read from the peer")
    return out


async def amain(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="aenv-bench-p2p-", dir="/var/tmp") as tmp, \
            moto_server(Path(tmp)) as endpoint:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="bench")
        repo = OssRepository(bucket="bench", region="us-east-1", endpoint=endpoint,
                             addressing_style="path")
        redis_server = RedisServer()
        store = ClusterStore.from_url(redis_server.url)
        try:
            for mib in args.mib:
                print(f"p2p: {mib} MiB memory file, {args.runs} runs ...", flush=True)
                results[f"{mib}MiB"] = await measure(Path(tmp) / f"m{mib}", repo,
                                                     Registry(store), mib, args.runs)
        finally:
            await store.aclose()
            redis_server.stop()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = asyncio.run(amain(args))
    print(f"\n{'what':>15} {'repository (oss)':>17} {'peer (http)':>12} {'copy floor':>11} "
          f"{'peer/repo':>10} {'peer MiB/s':>11}")
    for size, r in results.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        mib = int(size.removesuffix("MiB"))
        for what, repo_k, peer_k in (("memory file", "repository", "peer"),
                                     ("layer", "layer repository", "layer peer")):
            print(f"{what + ' ' + size:>15} {med[repo_k] * 1000:>14.0f} ms "
                  f"{med[peer_k] * 1000:>9.0f} ms {med['copy'] * 1000:>8.0f} ms "
                  f"{med[peer_k] / med[repo_k]:>9.2f}x {mib / med[peer_k]:>11.0f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
