"""Storage's side of the metrics: the bytes each repository moves (posix_fs copies, not
hard links; oss, against a real moto S3 server), the chunk cache's hits and misses, the
block server's `stats` control request, and what `NodeRuntime(metrics=)` reports at a
scrape (VM memory, the `memory/` cache, repository bytes; the block server's part left
out while it does not answer)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import boto3  # type: ignore[import-untyped]
import pytest

from host.metrics import Metrics
from host.runtime import NodeRuntime, RuntimeConfig
from host.runtime.memory import MEMORY_KEY
from host.storage.blockserver import BlockServer
from host.storage.cache import ChunkCache
from host.storage.control import BlockServerClient
from host.storage.repository import OssRepository, PosixFsRepository

from .scrape import parse

MiB = 1 << 20


def _layer(repo: PosixFsRepository, data: bytes) -> str:
    """A file under the repository's layers/ (read_layer does not parse it)."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (repo.root / "layers" / f"{digest[7:]}.lsmt").write_bytes(data)
    return digest


def test_posix_fs_counts_copies_not_links(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    src = tmp_path / "mem"
    src.write_bytes(os.urandom(3000))
    repo.put_file("memory/a/mem", src)  # one filesystem: a hard link
    assert (repo.transferred.upload_bytes, repo.transferred.download_bytes) == (0, 0)
    repo.put_manifest("m", {"k": "v"})
    body = len(json.dumps({"k": "v"}, sort_keys=True))
    assert repo.transferred.upload_bytes == body
    assert repo.get_manifest("m") == {"k": "v"}
    assert repo.transferred.download_bytes == body

    def no_links(*args: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)  # as if the repository were elsewhere
    repo.put_file("memory/b/mem", src)
    assert repo.transferred.upload_bytes == body + 3000
    repo.fetch_file("memory/b/mem", tmp_path / "back")
    assert repo.transferred.download_bytes == body + 3000
    data = b"x" * 5000
    digest = _layer(repo, data)
    assert repo.read_layer(digest, 100, 1000) == data[100:1100]
    assert repo.transferred.download_bytes == body + 3000 + 1000


def test_oss_counts_what_goes_over_the_wire(moto_endpoint: str, s3_env: dict[str, str],
                                            tmp_path: Path) -> None:
    bucket = f"m{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    repo = OssRepository(bucket=bucket, region="us-east-1", endpoint=moto_endpoint,
                         prefix="p")
    src = tmp_path / "mem"
    with open(src, "wb") as f:  # 4 MiB of zeros then 1 MiB of noise: compresses well
        f.seek(4 * MiB)
        f.write(os.urandom(MiB))
    repo.put_file("memory/a/mem", src)
    stored = repo.s3.head_object(Bucket=bucket, Key=repo._file_key("memory/a/mem"))
    assert repo.transferred.upload_bytes == stored["ContentLength"] < 2 * MiB
    repo.fetch_file("memory/a/mem", tmp_path / "back")
    assert repo.transferred.download_bytes == stored["ContentLength"]
    assert (tmp_path / "back").read_bytes() == src.read_bytes()

    up, down = repo.transferred.upload_bytes, repo.transferred.download_bytes
    layer = tmp_path / "layer"
    layer.write_bytes(os.urandom(MiB))
    digest = "sha256:" + hashlib.sha256(layer.read_bytes()).hexdigest()
    repo.put_layer(digest, layer)
    assert repo.transferred.upload_bytes > up + MiB  # the layer and its chunk sums
    repo.read_layer(digest, 0, 4096)
    assert repo.transferred.download_bytes == down + 4096


def test_chunk_cache_hits_misses_and_the_block_server_stats(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    digest = _layer(repo, os.urandom(3 * MiB))
    cache = ChunkCache(tmp_path / "cache", capacity_bytes=64 * MiB)
    for idx in (0, 0, 1, 0):
        os.close(cache.open_chunk(repo, digest, idx, MiB))
    assert (cache.stats.hits, cache.stats.misses) == (2, 2)
    bs = BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st", repository=repo,
                     cache=cache)
    assert bs.stats() == {
        "cache": {"used_bytes": 2 * MiB, "capacity_bytes": 64 * MiB, "hits": 2, "misses": 2},
        "repository": {"backend": "posix_fs", "upload_bytes": 0,
                       "download_bytes": 2 * MiB}}
    assert BlockServer(socket_dir=tmp_path / "s2", state_dir=tmp_path / "st2").stats() == {
        "cache": None, "repository": None}


async def test_block_server_answers_stats_over_its_control_socket(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    bs = BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st", repository=repo,
                     cache=ChunkCache(tmp_path / "cache", capacity_bytes=8 * MiB))
    await bs.start()
    try:
        stats = await BlockServerClient(bs.control_socket).stats()
    finally:
        await bs.aclose()
    assert stats["cache"] == {"used_bytes": 0, "capacity_bytes": 8 * MiB, "hits": 0,
                              "misses": 0}
    assert stats["repository"]["backend"] == "posix_fs"


async def test_runtime_reports_memory_cache_and_repository_bytes(tmp_path: Path) -> None:
    m = Metrics()
    cfg = RuntimeConfig(state_dir=tmp_path / "state", run_dir=tmp_path / "run",
                        memory_cache_mib=64)
    rt = NodeRuntime(cfg, metrics=m)  # not opened: no block server answers
    memory = rt.parts.memory
    (cfg.memory_dir / "t" / "base").mkdir(parents=True)
    (cfg.memory_dir / "t" / "base" / "base.dev").write_bytes(os.urandom(8192))
    kept = tmp_path / "elsewhere.mem"
    kept.write_bytes(os.urandom(4096))
    memory.repo.put_file(MEMORY_KEY + "s/mem/diff.mem", kept)  # in the repository only
    await rt.manifests.put("s", {"k": 1})
    await memory.fetch({"snapshot_id": "s", "memory": {
        "files": ["t/base/base.dev", "s/mem/diff.mem"]}})  # one here, one fetched

    page = parse((await m.render()).decode())
    assert page.value("aenv_cache_hits_total", cache="memory") == 1
    assert page.value("aenv_cache_misses_total", cache="memory") == 1
    assert page.value("aenv_cache_capacity_bytes", cache="memory") == 64 * MiB
    assert page.value("aenv_cache_used_bytes", cache="memory") >= 8192 + 4096
    assert ("aenv_cache_hits_total", frozenset({("cache", "chunks")})) not in page.samples
    manifest = len(json.dumps({"k": 1}, sort_keys=True))
    assert page.value("aenv_repository_bytes_total", direction="upload",
                      backend="posix_fs") == manifest  # the memory files were hard links
    assert page.value("aenv_repository_bytes_total", direction="download",
                      backend="posix_fs") == 0
    assert page.value("aenv_vm_memory_pss_bytes") == 0  # no VM runs
