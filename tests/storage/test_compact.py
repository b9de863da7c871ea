"""Compaction: a stack's own sealed layers merged into one, in process (BlockServer)."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest

from host.storage import blockserver as bsmod
from host.storage.blockserver import BlockServer
from host.storage.lsmt import SealedLayer
from host.storage.repository import PosixFsRepository

KiB, MiB = 1 << 10, 1 << 20
SIZE = 8 * MiB


def _server(tmp_path: Path) -> BlockServer:
    return BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st",
                       repository=PosixFsRepository(tmp_path / "repo"))


async def _scribble(bs: BlockServer, name: str, model: bytearray, rng: random.Random,
                    n: int = 12) -> None:
    """Random writes, unaligned writes and zeroes through the export, mirrored in `model`."""
    exp = bs._stacks[name]
    for _ in range(n):
        off = rng.randrange(0, SIZE - 256 * KiB)
        length = rng.randrange(1, 256 * KiB)
        if rng.random() < 0.25:
            await exp.write_zeroes(off, length)
            model[off:off + length] = bytes(length)
        else:
            data = rng.randbytes(length)
            await exp.write(off, data)
            model[off:off + length] = data


async def _base(bs: BlockServer, rng: random.Random) -> tuple[str, bytearray]:
    """A 'template' layer, filled everywhere with data (its zeroes and holes would not
    show whether a merged layer hides or lets through what is below it)."""
    model = bytearray(rng.randbytes(SIZE))
    await bs.create("tpl", [], virtual_size=SIZE)
    await bs._stacks["tpl"].write(0, bytes(model))
    digest = await bs.seal("tpl")
    await bs.delete("tpl")
    return digest, model


async def test_merged_layers_read_the_same_and_the_stack_goes_on(tmp_path: Path) -> None:
    rng = random.Random(7)
    async with _server(tmp_path) as bs:
        base, model = await _base(bs, rng)
        await bs.create("sbx", [base])
        for _ in range(9):  # nine pauses
            await _scribble(bs, "sbx", model, rng)
            await bs.seal("sbx")
        await _scribble(bs, "sbx", model, rng)  # unsealed writes in the upper
        stack = bs._stacks["sbx"].stack
        assert len(stack.layers) == 10 and stack.read(0, SIZE) == model
        old = [layer.digest for layer in stack.layers[1:]]

        out = await bs.compact("sbx", 1)

        assert out["merged"] == 9 and out["layers"] == 2
        info = await bs.info("sbx")
        assert info.layers == (base, out["digest"])
        assert stack.read(0, SIZE) == model  # upper over the merged layer: same disk
        merged = SealedLayer.open_path(tmp_path / "st" / "layers" / f"{out['digest'][7:]}.lsmt")
        assert merged.uuid == bs.layers.open(old[-1]).uuid  # the upper's parent is still valid
        merged.close()
        assert PosixFsRepository(tmp_path / "repo").has_layer(out["digest"])
        await _scribble(bs, "sbx", model, rng)
        await bs.seal("sbx")
        assert stack.read(0, SIZE) == model
    async with _server(tmp_path) as bs2:  # the stack's record names the merged layer
        assert len((await bs2.info("sbx")).layers) == 3
        assert bs2._stacks["sbx"].stack.read(0, SIZE) == model


async def test_zeroes_in_the_run_still_hide_the_layers_below(tmp_path: Path) -> None:
    rng = random.Random(3)
    async with _server(tmp_path) as bs:
        base, model = await _base(bs, rng)
        await bs.create("z", [base])
        exp = bs._stacks["z"]
        await exp.write_zeroes(MiB, 2 * MiB)
        model[MiB:3 * MiB] = bytes(2 * MiB)
        await bs.seal("z")
        await exp.write(2 * MiB, b"\x07" * 4096)
        model[2 * MiB:2 * MiB + 4096] = b"\x07" * 4096
        await bs.seal("z")
        await bs.compact("z", 1)
        assert len(exp.stack.layers) == 2
        assert exp.stack.read(0, SIZE) == model
        # ...and sectors the run never wrote fall through to the base
        assert exp.stack.read(5 * MiB, 4096) == model[5 * MiB:5 * MiB + 4096]


class HeldCopy:
    """A compaction's copy stopped until `go` is set (`copying` says it started)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go, self.copying = threading.Event(), threading.Event()
        real = bsmod.write_merged

        def slow(run: list[SealedLayer], path: Path) -> str:
            self.copying.set()
            assert self.go.wait(30)
            return real(run, path)

        monkeypatch.setattr(bsmod, "write_merged", slow)


async def test_pauses_during_a_compaction_stay_on_top(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(11)
    held = HeldCopy(monkeypatch)
    async with _server(tmp_path) as bs:
        base, model = await _base(bs, rng)
        await bs.create("p", [base])
        for _ in range(4):
            await _scribble(bs, "p", model, rng)
            await bs.seal("p")
        task = asyncio.create_task(bs.compact("p", 1))
        assert await asyncio.to_thread(held.copying.wait, 30)
        await _scribble(bs, "p", model, rng)  # the guest writes and pauses meanwhile
        top = await bs.seal("p")
        await _scribble(bs, "p", model, rng)
        held.go.set()
        out = await task
        assert out["merged"] == 4
        assert (await bs.info("p")).layers == (base, out["digest"], top)
        assert bs._stacks["p"].stack.read(0, SIZE) == model


async def test_a_stack_deleted_during_its_compaction_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldCopy(monkeypatch)
    async with _server(tmp_path) as bs:
        base, _ = await _base(bs, random.Random(5))
        await bs.create("k", [base])
        for i in range(3):
            await bs._stacks["k"].write(i * MiB, b"k" * 4096)
            await bs.seal("k")
        await bs.create("keep", [base])  # holds the base open
        task = asyncio.create_task(bs.compact("k", 1))
        assert await asyncio.to_thread(held.copying.wait, 30)
        # the run's layers are held by the compaction's copy, not closed under it
        await bs.delete("k")
        held.go.set()
        out = await task
        assert out["digest"] is None and "k" not in bs._stacks
        # no .tmp left behind; the merged file (named by nothing) is the collector's
        assert not list((tmp_path / "st" / "layers").glob("*.tmp"))


async def test_nothing_to_merge(tmp_path: Path) -> None:
    async with _server(tmp_path) as bs:
        base, _ = await _base(bs, random.Random(1))
        await bs.create("n", [base])
        await bs._stacks["n"].write(0, b"n" * 4096)
        await bs.seal("n")
        assert (await bs.compact("n", 1))["digest"] is None  # one own layer: nothing to do
        assert (await bs.compact("n", 5))["digest"] is None
