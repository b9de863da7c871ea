"""The block server's layer collection (`BlockServer.collect`): a real server, real sealed
layers in its state dir and a posix_fs repository of hard links, as on a default node."""

from __future__ import annotations

import os
import time
from pathlib import Path

from host.storage.blockserver import BlockServer
from host.storage.collect import layer_hex, sweep_layers
from host.storage.repository import PosixFsRepository

MiB = 1 << 20


def _server(tmp_path: Path) -> BlockServer:
    return BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st",
                       repository=PosixFsRepository(tmp_path / "repo"))


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


async def _layer(bs: BlockServer, name: str, fill: bytes) -> str:
    await bs.create(name, [], virtual_size=MiB)
    await bs._stacks[name].write(0, fill * 65536)
    return await bs.seal(name)


async def test_unnamed_old_layers_go_and_everything_in_use_stays(tmp_path: Path) -> None:
    async with _server(tmp_path) as bs:
        kept = await _layer(bs, "kept", b"k")      # named by a document
        held = await _layer(bs, "held", b"h")      # a live stack's
        gone = await _layer(bs, "gone", b"g")
        young = await _layer(bs, "young", b"y")    # just sealed: no document yet
        for name in ("kept", "gone", "young"):
            await bs.delete(name)
        local, repo = tmp_path / "st" / "layers", tmp_path / "repo" / "layers"
        for d in (kept, held, gone):
            for root in (local, repo):
                _age(root / f"{layer_hex(d)}.lsmt", 3600)
        (local / "abandoned.tmp").write_bytes(b"x" * 4096)   # a crashed import's copy
        _age(local / "abandoned.tmp", 3600)

        dry = await bs.collect([kept], min_age_s=600, dry_run=True, repository="sweep")
        assert set(dry["local"]["digests"]) == {layer_hex(gone), "abandoned.tmp"}
        assert (local / f"{layer_hex(gone)}.lsmt").exists()  # a dry run removes nothing

        out = await bs.collect([kept], min_age_s=600, repository="sweep")
        assert set(out["local"]["digests"]) == {layer_hex(gone), "abandoned.tmp"}
        assert out["repository"]["digests"] == [layer_hex(gone)]
        assert out["in_use"] == [held]
        # the layer's bytes are counted once for its two hard links
        assert 0 < out["local"]["bytes"] + out["repository"]["bytes"] < 2 * 65536 + 8192 + 4096
        remaining = {p.name for p in local.iterdir()}
        assert remaining == {f"{layer_hex(d)}.lsmt" for d in (kept, held, young)}
        assert {p.name for p in repo.iterdir()} == remaining
        assert bs._stacks["held"].stack.read(0, 4) == b"hhhh"
        # what stayed still starts a stack
        await bs.create("again", [kept], virtual_size=MiB)
        assert bs._stacks["again"].stack.read(0, 4) == b"kkkk"


async def test_without_repository_the_repository_copies_stay(tmp_path: Path) -> None:
    async with _server(tmp_path) as bs:
        d = await _layer(bs, "x", b"x")
        await bs.delete("x")
        _age(tmp_path / "st" / "layers" / f"{layer_hex(d)}.lsmt", 3600)
        out = await bs.collect([], min_age_s=600)
        assert out["local"]["files"] == 1 and out["repository"]["files"] == 0
        assert out["local"]["bytes"] == 0   # its repository link still holds the bytes
        assert PosixFsRepository(tmp_path / "repo").has_layer(d)
        # the stack can still be made from the repository's copy
        await bs.create("y", [d], virtual_size=MiB)
        assert bs._stacks["y"].stack.read(0, 2) == b"xx"


def test_sweep_keeps_named_and_young_files(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.lsmt").write_bytes(b"z" * 4096)
    _age(tmp_path / "a.lsmt", 100)
    _age(tmp_path / "b.lsmt", 100)
    out = sweep_layers(tmp_path, ["sha256:a"], min_age_s=50, dry_run=False)
    assert out.digests == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.lsmt", "c.lsmt"]
