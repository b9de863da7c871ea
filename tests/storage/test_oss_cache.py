"""The oss (S3) repository against a real moto server process, and lazy chunked reads
through the bounded cache, in process and through the block server."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest

from host.storage.cache import ChunkCache
from host.storage.convert import convert_image
from host.storage.errors import LayerNotFoundError, RepositoryConfigError, RepositoryError
from host.storage.lsmt import LayerWriter, SealedLayer
from host.storage.repository import OssRepository, PosixFsRepository, open_repository
from host.storage.stack import Stack
from host.storage.upper import Upper

from .conftest import BlockServerProc, qemu_tool
from .test_blockserver import RawNbd, _ext4_image

MiB = 1 << 20


@pytest.fixture
def bucket(moto_endpoint: str, s3_env: dict[str, str]) -> str:
    name = f"b{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=name)
    return name


def _repo(moto_endpoint: str, bucket: str, **kw: Any) -> OssRepository:
    return OssRepository(bucket=bucket, region="us-east-1", endpoint=moto_endpoint,
                         prefix="aenv/test", **kw)


def test_region_is_required() -> None:
    with pytest.raises(RepositoryConfigError, match="region is required"):
        OssRepository(bucket="b", region=None, endpoint="http://127.0.0.1:1")
    with pytest.raises(RepositoryConfigError, match="region is required"):
        open_repository("oss://bucket/prefix?endpoint=http://127.0.0.1:1")
    with pytest.raises(RepositoryConfigError, match="bucket"):
        OssRepository(bucket="", region="us-east-1")


def _layer(tmp_path: Path, mib: int) -> tuple[Path, str, bytes]:
    data = os.urandom(mib * MiB)
    p = tmp_path / f"l{mib}.lsmt"
    w = LayerWriter(p, (mib + 1) * MiB)
    w.write(MiB // 2, data)
    return p, w.finish(), data


def test_oss_layers_and_manifests_round_trip(moto_endpoint: str, bucket: str,
                                             tmp_path: Path) -> None:
    repo = _repo(moto_endpoint, bucket, multipart_chunk_mib=5)
    path, digest, _ = _layer(tmp_path, 12)  # > 5 MiB: a multipart upload
    assert not repo.has_layer(digest)
    with pytest.raises(LayerNotFoundError):
        repo.read_layer(digest, 0, 10)
    repo.put_layer(digest, path)
    assert repo.has_layer(digest)
    assert repo.layer_size(digest) == path.stat().st_size
    raw = path.read_bytes()
    assert repo.read_layer(digest, 4096, 1000) == raw[4096:5096]
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")
    repo.put_manifest("snap1", {"rootfs_layers": [digest]})
    assert repo.get_manifest("snap1") == {"rootfs_layers": [digest]}
    assert repo.list_manifests() == ["snap1"]
    with pytest.raises(RepositoryError):
        repo.get_manifest("missing")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert f"aenv/test/layers/{digest[7:]}.lsmt" in keys


def test_unfinished_upload_is_invisible(moto_endpoint: str, bucket: str, tmp_path: Path) -> None:
    """A crash mid-upload leaves only an incomplete multipart upload: no layer appears."""
    repo = _repo(moto_endpoint, bucket)
    path, digest, _ = _layer(tmp_path, 6)
    s3 = repo.s3
    key = repo._key(digest)
    up = s3.create_multipart_upload(Bucket=bucket, Key=key)
    s3.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1,
                   Body=path.read_bytes()[:5 * MiB])
    assert not repo.has_layer(digest)  # the "crash" happened here
    repo.put_layer(digest, path)  # a retry completes normally
    assert repo.read_layer(digest, 0, 4096) == path.read_bytes()[:4096]


def test_posix_fs_writes_are_atomic(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "r")
    path, digest, _ = _layer(tmp_path, 1)
    repo.put_layer(digest, path)
    repo.put_manifest("m", {"a": 1})
    leftovers = [p for p in (tmp_path / "r").rglob(".tmp-*")]
    assert leftovers == []
    assert repo.local_path(digest) is not None and repo.get_manifest("m") == {"a": 1}


def test_lazy_reads_with_eviction_under_small_cache(moto_endpoint: str, bucket: str,
                                                    tmp_path: Path) -> None:
    repo = _repo(moto_endpoint, bucket)
    path, digest, data = _layer(tmp_path, 10)
    repo.put_layer(digest, path)
    cache = ChunkCache(tmp_path / "cache", capacity_bytes=3 * MiB, high=0.9, low=0.5)
    layer = SealedLayer.open(cache.blob(repo, digest), digest=digest)
    stack = Stack("s", [layer], Upper.create(tmp_path / "u", 11 * MiB))
    try:
        # only the trailer and index chunks were fetched to open the layer
        assert cache.stats.fetched_bytes <= 2 * MiB
        for _round in range(2):  # a second pass re-fetches evicted chunks
            for off in range(0, 10 * MiB, 256 * 1024):
                got = stack.read(MiB // 2 + off, 256 * 1024)
                assert got == data[off:off + 256 * 1024]
                assert cache.used_bytes <= 3 * MiB
        assert cache.stats.evictions > 0
        on_disk = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.is_file())
        assert on_disk <= 3 * MiB
        # a write on top still works while base chunks come and go
        stack.write(MiB, b"w" * 4096)
        assert stack.read(MiB - 512, 512) == data[MiB // 2 - 512:MiB // 2]
        assert stack.read(MiB, 4096) == b"w" * 4096
    finally:
        stack.close()


def test_block_server_serves_oss_layers_through_small_cache(
        moto_endpoint: str, bucket: str, s3_env: dict[str, str], tmp_path: Path) -> None:
    qemu_img = qemu_tool("qemu-img")
    img = _ext4_image(tmp_path, mib=48)
    out = tmp_path / "layers"
    out.mkdir()
    path, digest, vsize = convert_image(img, out)
    assert path.stat().st_size > 5 * MiB  # bigger than the cache below
    spec = f"oss://{bucket}/aenv?endpoint={moto_endpoint}&region=us-east-1"
    open_repository(spec).put_layer(digest, path)
    path.unlink()  # only the repository has it now

    bs = BlockServerProc(tmp_path / "bs", repo=spec, cache_mib=2, extra_env=s3_env)
    bs.root.mkdir()
    bs.start()
    try:
        info = bs.client.create("remote", [digest])
        assert info.virtual_size == vsize
        # NBD_CMD_CACHE prefetches the chunks behind a range into the cache
        before = {p.name for p in (bs.root / "cache").rglob("*") if p.is_file()}
        n = RawNbd(bs.nbd_socket)
        n.go("remote")
        assert n.request(5, 0, 32 * MiB) == (0, b"")
        n.close()
        after = {p.name for p in (bs.root / "cache").rglob("*") if p.is_file()}
        assert after - before
        for _ in range(2):
            subprocess.run([qemu_img, "compare", "-f", "raw", "-F", "raw", str(img),
                            info.nbd_uri], check=True, timeout=300)
        cached = sum(p.stat().st_size for p in (bs.root / "cache").rglob("*") if p.is_file())
        assert cached <= 2 * MiB
        # writes land in the upper; a seal uploads the new layer to S3
        qio = qemu_tool("qemu-io")
        subprocess.run([qio, "-f", "raw", "-c", "write -P 0x5a 0 64k", info.nbd_uri],
                       check=True, timeout=60)
        d2 = bs.client.seal("remote")
        assert open_repository(spec).has_layer(d2)
        r = subprocess.run([qio, "-f", "raw", "-c", "read -P 0x5a 0 64k", info.nbd_uri],
                           check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "failed" not in r.stdout
    finally:
        bs.stop()
