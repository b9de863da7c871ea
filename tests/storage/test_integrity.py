"""What comes back from an `oss` repository (a real moto S3 server process) is checked
against what was recorded when it went in (issue 14 item 24): each layer chunk the cache
fetches against the layer's chunk sums, each file against the sha256 `put_file` returned.
A bad transfer is fetched once more; bad stored data is an IntegrityError and is never
returned or left in the cache."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest

from host.storage.cache import ChunkCache
from host.storage.errors import IntegrityError
from host.storage.lsmt import LayerWriter, SealedLayer
from host.storage.repository import OssRepository, PosixFsRepository

MiB = 1 << 20


@pytest.fixture
def repo(moto_endpoint: str, s3_env: dict[str, str]) -> Iterator[OssRepository]:
    bucket = f"i{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    yield OssRepository(bucket=bucket, region="us-east-1", endpoint=moto_endpoint,
                        prefix="p", multipart_chunk_mib=5)


class FlakyS3:
    """The repository's S3 client, except that the first `times` reads of `key` get the
    bytes of `bad_key` (a transfer that went wrong on the way)."""

    def __init__(self, s3: Any, key: str, bad_key: str, times: int) -> None:
        self.s3, self.key, self.bad_key, self.left = s3, key, bad_key, times

    def __getattr__(self, name: str) -> Any:
        return getattr(self.s3, name)

    def _pick(self, key: str) -> str:
        if key == self.key and self.left > 0:
            self.left -= 1
            return self.bad_key
        return key

    def get_object(self, **kw: Any) -> Any:
        return self.s3.get_object(**{**kw, "Key": self._pick(kw["Key"])})

    def download_fileobj(self, bucket: str, key: str, fileobj: Any, **kw: Any) -> None:
        self.s3.download_fileobj(bucket, self._pick(key), fileobj, **kw)


def _layer(tmp: Path, mib: int = 6) -> tuple[Path, str]:
    p = tmp / "layer.lsmt"
    w = LayerWriter(p, (mib + 1) * MiB)
    w.write(0, os.urandom(mib * MiB))
    return p, w.finish()


def _damaged_copy(repo: OssRepository, path: Path, digest: str, at: int) -> str:
    """A copy of the layer object with one byte flipped at `at`; returns its key."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    key = repo._key(digest).replace(".lsmt", ".bad")
    repo.s3.put_object(Bucket=repo.bucket, Key=key, Body=bytes(raw))
    return key


def _chunk_files(cache_dir: Path) -> set[str]:
    return {p.name for p in cache_dir.rglob("*") if p.is_file()}


def test_a_bad_chunk_is_fetched_again_then_refused(repo: OssRepository, tmp_path: Path) -> None:
    path, digest = _layer(tmp_path)
    repo.put_layer(digest, path)
    raw = path.read_bytes()
    bad = _damaged_copy(repo, path, digest, 3 * MiB + 17)
    good_s3 = repo.s3
    # one bad transfer: fetched again, the good bytes are served
    repo.s3 = FlakyS3(good_s3, repo._key(digest), bad, times=1)
    cache = ChunkCache(tmp_path / "c1", capacity_bytes=64 * MiB)
    blob = cache.blob(repo, digest)
    assert blob.pread(3 * MiB, MiB) == raw[3 * MiB:4 * MiB]
    assert cache.stats.corrupt == 1 and repo.s3.left == 0
    # bad every time (damaged at rest): an error, nothing served, nothing cached
    repo.s3 = FlakyS3(good_s3, repo._key(digest), bad, times=99)
    cache = ChunkCache(tmp_path / "c2", capacity_bytes=64 * MiB)
    blob = cache.blob(repo, digest)
    with pytest.raises(IntegrityError, match="do not match"):
        blob.pread(3 * MiB + 4096, 4096)
    assert cache.stats.corrupt == 2  # fetched twice
    assert "3" not in _chunk_files(tmp_path / "c2") and cache.used_bytes == 0
    assert not [n for n in _chunk_files(tmp_path / "c2") if n.startswith(".tmp")]
    with pytest.raises(IntegrityError):  # asked again: still refused, still not kept
        list(blob.pieces(3 * MiB, 512))
    assert blob.pread(0, 4096) == raw[:4096]  # the other chunks are fine
    assert _chunk_files(tmp_path / "c2") == {"0"}


def test_layers_opened_through_the_cache_are_checked(repo: OssRepository,
                                                     tmp_path: Path) -> None:
    """The trailer and index a layer is opened with come through the same check."""
    path, digest = _layer(tmp_path)
    repo.put_layer(digest, path)
    size = path.stat().st_size
    bad = _damaged_copy(repo, path, digest, size - 100)  # in the trailer's chunk
    repo.s3 = FlakyS3(repo.s3, repo._key(digest), bad, times=99)
    cache = ChunkCache(tmp_path / "c", capacity_bytes=64 * MiB)
    with pytest.raises(IntegrityError):
        SealedLayer.open(cache.blob(repo, digest), digest=digest)


def test_upload_records_sums_and_refuses_a_file_that_is_not_its_digest(
        repo: OssRepository, tmp_path: Path) -> None:
    path, digest = _layer(tmp_path)
    other = tmp_path / "other.lsmt"
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0xFF
    other.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="does not match its digest"):
        repo.put_layer(digest, other)
    assert not repo.has_layer(digest) and repo.layer_sums(digest) is None
    repo.put_layer(digest, path)
    sums = repo.layer_sums(digest)
    assert sums is not None and sums.size == path.stat().st_size
    assert sums.sha256[0] == hashlib.sha256(path.read_bytes()[:MiB]).digest()


def test_layers_uploaded_before_sums_read_unchecked_and_get_them(
        repo: OssRepository, tmp_path: Path) -> None:
    path, digest = _layer(tmp_path)
    repo.put_layer(digest, path)
    repo.s3.delete_object(Bucket=repo.bucket, Key=repo._sums_key(digest))  # an old upload
    cache = ChunkCache(tmp_path / "c", capacity_bytes=64 * MiB)
    assert cache.blob(repo, digest).pread(MiB, 10) == path.read_bytes()[MiB:MiB + 10]
    repo.put_layer(digest, path)  # a later push of the same layer adds them
    assert repo.layer_sums(digest) is not None


def test_files_are_checked_against_the_sha256_of_their_upload(
        repo: OssRepository, tmp_path: Path) -> None:
    src = tmp_path / "base.mem"
    data = os.urandom(3 * MiB) + bytes(4 * MiB) + os.urandom(MiB)
    src.write_bytes(data)
    key = "memory/s/base/base.mem"
    sha = repo.put_file(key, src)
    assert sha == hashlib.sha256(data).hexdigest()
    dest = tmp_path / "node" / "base.mem"
    repo.fetch_file(key, dest, sha256=sha)
    assert dest.read_bytes() == data
    dest.unlink()
    # another valid object of the same size in its place, then a non-zstd one: refused
    other = tmp_path / "other"
    other.write_bytes(os.urandom(len(data)))
    repo.put_file("memory/junk/a", other)
    repo.s3.put_object(Bucket=repo.bucket, Key=repo._file_key("memory/junk/b"),
                       Body=b"not zstd at all")
    for junk in ("memory/junk/a", "memory/junk/b"):
        flaky = FlakyS3(repo.s3, repo._file_key(key), repo._file_key(junk), times=2)
        bad = OssRepository.__new__(OssRepository)
        bad.__dict__.update(repo.__dict__, s3=flaky)
        with pytest.raises(IntegrityError):
            bad.fetch_file(key, dest, sha256=sha)
        assert flaky.left == 0  # fetched twice
        assert not dest.exists() and not list(dest.parent.iterdir())  # no partial file
    # one bad transfer: fetched again
    flaky = FlakyS3(repo.s3, repo._file_key(key), repo._file_key("memory/junk/a"), times=1)
    repo.s3 = flaky
    repo.fetch_file(key, dest, sha256=sha)
    assert dest.read_bytes() == data and flaky.left == 0


def test_posix_fs_fetch_checks_a_given_sha256(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    src = tmp_path / "f"
    src.write_bytes(b"memory")
    assert repo.put_file("memory/a/f", src) is None  # a hard link: nothing was hashed
    dest = tmp_path / "out" / "f"
    with pytest.raises(IntegrityError):
        repo.fetch_file("memory/a/f", dest, sha256=hashlib.sha256(b"other").hexdigest())
    assert not dest.exists() and not list(dest.parent.iterdir())
    repo.fetch_file("memory/a/f", dest, sha256=hashlib.sha256(b"memory").hexdigest())
    assert dest.read_bytes() == b"memory"
