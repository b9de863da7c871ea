"""The running digest of an upper's data file, and its rehash beside the writer: a
snapshot starts it before it stops the guest, so the seal need not read the whole file
while the guest waits. A wrong digest here names a layer by bytes it does not hold."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

import pytest

from host.storage import appender
from host.storage.appender import Appender
from host.storage.blockserver import BlockServer
from host.storage.lsmt import digest_of_file
from host.storage.repository import PosixFsRepository

MiB = 1 << 20


def _file_sha(fd: int) -> str:
    return hashlib.sha256(os.pread(fd, os.fstat(fd).st_size, 0)).hexdigest()


@pytest.fixture
def out(tmp_path: Path):  # type: ignore[no-untyped-def]
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o644)
    a = Appender(fd, 0, hashlib.sha256())
    a.append(os.urandom(3 * MiB))
    yield a
    os.close(fd)


def _overwrite(a: Appender, at: int, data: bytes) -> None:
    os.pwrite(a.fd, data, at)
    a.overwritten()


def test_rehash_beside_then_appends_gives_the_files_digest(out: Appender) -> None:
    _overwrite(out, 4096, b"o" * 4096)
    done = out.rehash_beside()
    assert done is not None and done.end == 3 * MiB
    out.append(os.urandom(MiB + 512))  # the writer went on meanwhile
    assert out.adopt(done)
    assert not out.hasher_stale
    out.append(b"t" * 512)  # the running hash goes on from the adopted one
    assert out.digest_state().hexdigest() == _file_sha(out.fd)


def test_an_overwrite_after_the_rehash_started_voids_it(out: Appender) -> None:
    _overwrite(out, 0, b"a" * 512)
    done = out.rehash_beside()
    _overwrite(out, MiB, b"b" * 512)  # lands in bytes the rehash already read
    assert not out.adopt(done)
    assert out.hasher_stale
    assert out.digest_state().hexdigest() == _file_sha(out.fd)  # the seal rehashes


def test_an_overwrite_during_the_rehash_stops_it(out: Appender,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _overwrite(out, 0, b"a" * 512)
    monkeypatch.setattr(appender, "CHUNK", 4096)
    real_pread = os.pread
    reads = []

    def pread(fd: int, n: int, at: int) -> bytes:
        reads.append(at)
        if len(reads) == 3:  # mid-file: the writer rewrites a block it already read
            _overwrite(out, 0, b"c" * 512)
        return real_pread(fd, n, at)

    monkeypatch.setattr(appender.os, "pread", pread)
    assert out.rehash_beside() is None
    assert len(reads) == 3  # it stopped at the next chunk, not at the end of the file


def test_nothing_to_rehash_or_nothing_to_read(out: Appender) -> None:
    assert out.rehash_beside() is None  # the running hash holds: nothing to do
    assert not out.adopt(None)
    _overwrite(out, 0, b"a" * 512)
    assert out.rehash_beside(stop=lambda: True) is None
    other = Appender(out.fd, out.pos, hashlib.sha256())
    other.overwritten()
    assert not out.adopt(other.rehash_beside())  # another file's rehash


def test_rehash_reads_its_own_descriptor(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o644)
    a = Appender(fd, 0, hashlib.sha256())
    a.append(b"x" * 8192)
    a.overwritten()
    started, go = threading.Event(), threading.Event()
    real = appender._hash_range

    def slow(fd_: int, h, start: int, end: int, stop=lambda: False) -> bool:  # type: ignore[no-untyped-def]
        started.set()
        go.wait(5)
        return real(fd_, h, start, end, stop)

    appender._hash_range, saved = slow, real  # type: ignore[assignment]
    try:
        result: list[object] = []
        t = threading.Thread(target=lambda: result.append(a.rehash_beside()))
        t.start()
        started.wait(5)
        os.close(fd)  # the upper closes (a delete) while the rehash runs
        other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o644)  # may reuse fd
        os.write(other, b"y" * 8192)
        go.set()
        t.join(5)
        os.close(other)
    finally:
        appender._hash_range = saved  # type: ignore[assignment]
    done = result[0]
    assert done is not None
    assert done.hasher.hexdigest() == hashlib.sha256(b"x" * 8192).hexdigest()  # type: ignore[attr-defined]


async def test_seal_after_prehash_reads_only_what_came_since(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the block server: a guest rewrote blocks in place, a snapshot asks for the
    prehash, the guest writes on, the seal takes the prehash (it hashes only the bytes
    appended since) and the layer's digest is its file's sha256."""
    hashed: list[tuple[int, int]] = []
    real = appender._hash_range

    def counting(fd: int, h, start: int, end: int, stop=lambda: False) -> bool:  # type: ignore[no-untyped-def]
        hashed.append((start, end))
        return real(fd, h, start, end, stop)

    monkeypatch.setattr(appender, "_hash_range", counting)
    async with BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st",
                           repository=PosixFsRepository(tmp_path / "repo")) as bs:
        await bs.create("p", [], virtual_size=64 * MiB)
        exp = bs._stacks["p"]
        await exp.write(0, os.urandom(8 * MiB))
        await exp.write(MiB, b"r" * 65536)  # rewritten in place: the running hash is void
        assert exp.stack.upper.out.hasher_stale
        await bs.prehash("p")
        await bs.prehash("p")  # asked twice: one rehash
        await asyncio.sleep(0)
        await exp.write(16 * MiB, b"n" * MiB)  # appended while the rehash runs
        digest = await bs.seal("p", upload=False)
        layer_file = bs.state.layer_path(digest)
        assert digest == digest_of_file(layer_file)
        full = [r for r in hashed if r[0] == 0]
        assert len(full) == 1, hashed  # the prehash's; the seal read no whole file
        tail = [r for r in hashed if r[0] > 0]
        assert sum(e - s for s, e in tail) <= MiB  # (none if the rehash began after it)
        assert exp.stack.read(MiB, 65536) == b"r" * 65536


async def test_a_voided_prehash_leaves_the_seal_honest(tmp_path: Path) -> None:
    async with BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st",
                           repository=PosixFsRepository(tmp_path / "repo")) as bs:
        await bs.create("v", [], virtual_size=64 * MiB)
        exp = bs._stacks["v"]
        await exp.write(0, os.urandom(4 * MiB))
        await exp.write(0, b"a" * 4096)
        await bs.prehash("v")
        await exp.write(8192, b"b" * 4096)  # rewritten again after the prehash started
        digest = await bs.seal("v", upload=False)
        assert digest == digest_of_file(bs.state.layer_path(digest))
        await exp.write(0, b"c" * 4096)  # the new upper: a prehash there, then a delete
        await exp.write(0, b"d" * 4096)
        await bs.prehash("v")
        await bs.delete("v")
