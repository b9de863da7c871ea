"""BlockServer in process: crash recovery paths, seal of an unchanged disk, deletes."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest

from host.storage.blockserver import BlockServer
from host.storage.repository import PosixFsRepository
from host.storage.statedir import StateDir

from .test_blockserver import RawNbd

MiB = 1 << 20


def _server(tmp_path: Path) -> BlockServer:
    return BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st",
                       repository=PosixFsRepository(tmp_path / "repo"))


async def test_seal_cut_by_a_crash_is_finished_at_recovery(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    bs = _server(tmp_path)
    await bs.start()
    await bs.create("m", [], virtual_size=MiB)
    exp = bs._stacks["m"]
    await exp.write(0, b"q" * 8192)
    await exp.flush()

    def crash(self: StateDir, exp: object) -> None:
        raise RuntimeError("crash between the layer rename and the manifest update")

    monkeypatch.setattr(StateDir, "save", crash)
    with pytest.raises(RuntimeError, match="crash"):
        await bs.seal("m", upload=False)
    monkeypatch.undo()
    await bs.aclose()  # the old manifest still names the old upper, now only a marker

    bs2 = _server(tmp_path)
    await bs2.start()
    try:
        info = await bs2.info("m")
        assert len(info.layers) == 1
        assert bs2._stacks["m"].stack.read(0, 8192) == b"q" * 8192
        uppers = list((tmp_path / "st" / "uppers").iterdir())
        assert [u.name for u in uppers] == [bs2._stacks["m"].upper_id]  # orphans collected
    finally:
        await bs2.aclose()


async def test_a_seal_cut_before_its_rename_is_finished_at_recovery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash after the seal's marker is durable but before the sealed file moved to
    layers/: the file is still in the upper, complete; recovery moves it and finishes."""
    bs = _server(tmp_path)
    await bs.start()
    await bs.create("c", [], virtual_size=MiB)
    await bs._stacks["c"].write(0, b"c" * 8192)
    await bs._stacks["c"].flush()
    placer = StateDir.placer

    def cut_placer(self: StateDir, upper_dir: Path):  # type: ignore[no-untyped-def]
        place = placer(self, upper_dir)

        def cut(digest: str, data_file: Path) -> Path:
            monkeypatch.setattr(os, "replace", _crash)  # the marker is written, not the rename
            try:
                return place(digest, data_file)
            finally:
                monkeypatch.setattr(os, "replace", real_replace)
        return cut

    real_replace = os.replace
    monkeypatch.setattr(StateDir, "placer", cut_placer)
    with pytest.raises(RuntimeError, match="crash"):
        await bs.seal("c", upload=False)
    monkeypatch.undo()
    await bs.aclose()
    assert not list((tmp_path / "st" / "layers").glob("*.lsmt"))

    bs2 = _server(tmp_path)
    await bs2.start()
    try:
        info = await bs2.info("c")
        assert len(info.layers) == 1
        assert bs2.state.layer_path(info.layers[0]).exists()
        assert bs2._stacks["c"].stack.read(0, 8192) == b"c" * 8192
    finally:
        await bs2.aclose()


def _crash(*args: object, **kwargs: object) -> None:
    raise RuntimeError("crash between the seal's marker and its rename")


async def test_a_stack_that_cannot_be_recovered_does_not_stop_the_others(
        tmp_path: Path) -> None:
    async with _server(tmp_path) as bs:
        for name in ("a-broken", "b-fine"):
            await bs.create(name, [], virtual_size=MiB)
            await bs._stacks[name].write(0, name.encode() * 512)
            await bs._stacks[name].flush()
        broken_upper = bs._stacks["a-broken"].stack.upper.dir
    (broken_upper / "data.lsmt").unlink()  # the first stack (sorted) cannot come back
    async with _server(tmp_path) as bs2:
        assert [i.name for i in await bs2.list()] == ["b-fine"]
        assert bs2._stacks["b-fine"].stack.read(0, 6) == b"b-fine"
        assert broken_upper.exists()  # left in place, not collected as an orphan


async def test_seal_of_unchanged_disk_adds_no_layer(tmp_path: Path) -> None:
    async with _server(tmp_path) as bs:
        await bs.create("u", [], virtual_size=MiB)
        await bs._stacks["u"].write(0, b"x" * 4096)
        d1 = await bs.seal("u")
        assert await bs.seal("u") == d1
        assert (await bs.info("u")).layers == (d1,)
        assert PosixFsRepository(tmp_path / "repo").has_layer(d1)


async def test_delete_drops_connections_and_layers(tmp_path: Path) -> None:
    async with _server(tmp_path) as bs:
        await bs.create("d", [], virtual_size=MiB)
        await bs._stacks["d"].write(0, b"x" * 4096)
        await bs.clone("d", "e")
        assert len(bs.layers) == 1
        import asyncio

        def connect_and_go() -> RawNbd:
            n = RawNbd(bs.nbd_socket)
            n.go("d")
            return n

        n = await asyncio.to_thread(connect_and_go)
        await bs.delete("d")
        assert len(bs.layers) == 1  # still used by e

        def request_after_delete() -> None:
            with pytest.raises((EOFError, ConnectionError, socket.timeout)):
                n.s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, 1, 0, 512))
                n.recv(16)
            n.close()

        await asyncio.to_thread(request_after_delete)
        await bs.delete("e")
        assert len(bs.layers) == 0
        assert list((tmp_path / "st" / "uppers").iterdir()) == []



def _dirty_mib(path: Path) -> float:
    """MiB of `path`'s page cache still dirty (not yet sent to disk): the PFNs of its
    pages from a mapping's pagemap, their flags from /proc/kpageflags (needs root)."""
    import mmap
    import os

    size = path.stat().st_size
    n = size // 4096
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        for i in range(n):  # map every page (a read makes no page dirtier)
            m[i * 4096]
        where = os.path.realpath(path)
        line = next(x for x in Path("/proc/self/maps").read_text().splitlines()
                    if x.endswith(where))
        start = int(line.split("-", 1)[0], 16)
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            raw = os.pread(pm.fileno(), 8 * n, (start // 4096) * 8)
            dirty = 0
            for (entry,) in struct.iter_unpack("<Q", raw):
                if entry >> 63:  # present
                    pfn = entry & ((1 << 55) - 1)
                    (flags,) = struct.unpack("<Q", os.pread(kf.fileno(), 8, pfn * 8))
                    dirty += (flags >> 4) & 1  # KPF_DIRTY
    return dirty * 4096 / MiB


async def test_writes_are_sent_to_disk_behind_the_guest(tmp_path: Path) -> None:
    """Write-behind: past WRITE_BEHIND bytes the upper's dirty pages go to disk, so a
    flush (QEMU sends one at every pause) waits for the tail only."""
    import os

    from host.storage.export import WRITE_BEHIND

    if os.geteuid() != 0 or not os.access("/proc/kpageflags", os.R_OK):
        pytest.skip("reading page flags needs root and /proc/kpageflags")
    async with _server(tmp_path) as bs:
        await bs.create("w", [], virtual_size=256 * MiB)
        exp = bs._stacks["w"]
        chunk = os.urandom(MiB)
        total = WRITE_BEHIND + 16 * MiB
        for i in range(total // MiB):
            await exp.write(i * MiB, chunk)
        data = exp.stack.upper.dir / "data.lsmt"
        dirty = _dirty_mib(data)
        # without write-behind all 48 MiB would still be dirty (the kernel's own
        # writeback starts after 30 s or GiBs); with it, about the 16 MiB written since
        assert dirty <= total / MiB - WRITE_BEHIND / MiB + 4, dirty
        await exp.flush()
        assert _dirty_mib(data) == 0
