"""Repository files (memory snapshots): put, fetch, has, delete, on both backends — a
directory and a real moto S3 server process — with atomic visibility and bad keys refused."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import boto3  # type: ignore[import-untyped]
import pytest

from host.storage.errors import LayerNotFoundError
from host.storage.repository import OssRepository, PosixFsRepository
from host.storage.repository.files import copy_sparse

MiB = 1 << 20


@pytest.fixture(params=["posix_fs", "oss"])
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> PosixFsRepository | OssRepository:
    if request.param == "posix_fs":
        return PosixFsRepository(tmp_path / "repo")
    endpoint = request.getfixturevalue("moto_endpoint")
    request.getfixturevalue("s3_env")
    bucket = f"f{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    # a small multipart threshold: the 20 MiB file below goes up in parts
    return OssRepository(bucket=bucket, region="us-east-1", endpoint=endpoint, prefix="p",
                         multipart_chunk_mib=5)


def _sparse_file(path: Path) -> bytes:
    """20 MiB: data, a 12 MiB hole, data (like a guest memory file)."""
    head, tail = os.urandom(3 * MiB), os.urandom(5 * MiB)
    with open(path, "wb") as f:
        f.write(head)
        f.seek(15 * MiB)
        f.write(tail)
    return head + bytes(12 * MiB) + tail


def test_put_fetch_roundtrip(repo: PosixFsRepository | OssRepository, tmp_path: Path) -> None:
    src = tmp_path / "base.mem"
    want = _sparse_file(src)
    key = "memory/tpl/base/base.mem"
    assert not repo.has_file(key)
    repo.put_file(key, src)
    assert repo.has_file(key)
    dest = tmp_path / "node2" / "memory" / "tpl" / "base" / "base.mem"
    repo.fetch_file(key, dest)
    assert dest.read_bytes() == want
    assert dest.stat().st_blocks * 512 < 10 * MiB  # the 12 MiB hole is still a hole
    if isinstance(repo, OssRepository):  # stored compressed: the zeros cost nothing
        stored = repo.s3.head_object(Bucket=repo.bucket, Key=repo._file_key(key))
        assert stored["ContentLength"] < 9 * MiB
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".tmp")]
    # a put replaces (a retried snapshot may reuse its key)
    src.write_bytes(b"second")
    repo.put_file(key, src)
    repo.fetch_file(key, dest)
    assert dest.read_bytes() == b"second"


def test_posix_put_keeps_holes_and_shares_bytes(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    src = tmp_path / "base.mem"
    _sparse_file(src)
    repo.put_file("memory/a/base.mem", src)
    stored = tmp_path / "repo" / "files" / "memory" / "a" / "base.mem"
    assert stored.stat().st_ino == src.stat().st_ino  # same filesystem: a hard link
    other = tmp_path / "other.mem"
    copy_sparse(src, other)  # the cross-filesystem path
    assert other.read_bytes() == src.read_bytes()
    assert other.stat().st_blocks * 512 < 10 * MiB  # the 12 MiB hole stayed a hole


def test_missing_file_and_delete(repo: PosixFsRepository | OssRepository, tmp_path: Path) -> None:
    dest = tmp_path / "out" / "x"
    with pytest.raises(LayerNotFoundError):
        repo.fetch_file("memory/none/x", dest)
    assert not dest.exists()
    assert not dest.parent.exists() or not list(dest.parent.iterdir())  # no partial file
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    for key in ("memory/s1/mem/a", "memory/s1/mem/b", "memory/s10/mem/a"):
        repo.put_file(key, f)
    repo.delete_files("memory/s1")
    assert not repo.has_file("memory/s1/mem/a")
    assert not repo.has_file("memory/s1/mem/b")
    assert repo.has_file("memory/s10/mem/a")  # a prefix is a directory, not a string prefix


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "a/./b", ".hidden", "a/"])
def test_bad_keys_refused(key: str, tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    f = tmp_path / "f"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="bad file key"):
        repo.put_file(key, f)
    files = tmp_path / "repo" / "files"
    assert not files.exists() or not any(files.rglob("*"))
