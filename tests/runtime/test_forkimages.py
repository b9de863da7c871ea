"""`ForkImages` without a VM: a real frozen base and a real memsnap snapshot of a helper
process mapping it (as QEMU maps guest RAM), the node's `MemoryFiles` over a posix_fs
repository. When a fork's children share one image, how many starts make it, what the
repository holds, and what a failure leaves. (The same through QEMU, with a guest's memory:
tests/runtime/test_fork.py.)"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from host.contract import NetworkConfig
from host.runtime import starts
from host.runtime.adoption import kill
from host.runtime.forkimages import ForkImageError, ForkImages
from host.runtime.memory import MemoryFiles
from host.runtime.snapshots import snapshot
from host.storage.errors import RepositoryError
from host.storage.repository import open_repository
from host.vmm.memsnap import BaseImage, MemSnapshot, snapshot_incremental
from tests.vmm.memsnap.memsnap_helpers import Child, make_base
from tests.vmm.memsnap.test_memsnap_api import CFG, FakeQmp
from tests.vmm.memsnap.test_memsnap_devstate import template

from .fakenode import GatedDriver, fake_node, publish_template, ref

pytestmark = pytest.mark.asyncio(loop_scope="session")

NET = NetworkConfig()
PAGES = 1024  # 4 MiB of "RAM"
SNAP = "fork-snap"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[ForkImages, BaseImage, MemSnapshot, Child]]:
    memory = MemoryFiles(tmp_path / "memory", open_repository(f"posix_fs:{tmp_path / 'repo'}"),
                         bound_mib=64)
    d = memory.dir / "tpl" / "base"
    d.mkdir(parents=True)
    mem = make_base(d / "base.mem", PAGES, list(range(0, PAGES, 3)))
    (d / "base.dev").write_bytes(template())
    (d / "base.json").write_text(json.dumps(
        {"mem": "base.mem", "template": "base.dev", "size": PAGES * 4096,
         "sha256": hashlib.sha256(mem.read_bytes()).hexdigest()}))
    base = BaseImage.load(d)
    src = Child(base.mem_path)
    try:
        src.write("parent", list(range(100, 500)))  # 1.6 MiB of diff
        snap = asyncio.run(snapshot_incremental(FakeQmp("running"), src.pid, base.mem_path,
                                                base, memory.dir / SNAP / "mem",
                                                config_sha256=CFG))
        yield ForkImages(memory, min_mib=1), base, snap, src
    finally:
        src.kill()


async def test_several_children_share_one_image_made_once(
        node: tuple[ForkImages, BaseImage, MemSnapshot, Child]) -> None:
    forks, base, snap, src = node
    assert not forks.use(SNAP, snap, 1)  # a lone start (a resume) injects its chain
    assert forks.use(SNAP, snap, 1)      # a second one (a checkpoint branched twice) shares
    fresh = ForkImages(forks.memory, min_mib=1)
    assert fresh.use(SNAP, snap, 4)      # several children at once share
    fresh.min_mib = 2
    assert not fresh.use("other", snap, 16)  # 1.6 MiB of diff each: not worth a copy

    got = await asyncio.gather(*(forks.image(SNAP, base, snap) for _ in range(4)))
    assert forks.made == 1 and sum("flatten_s" in t for _, _, t in got) == 1
    flat, sha, _ = got[0]
    assert {g[0] for g in got} == {flat} and flat.dir == forks.memory.dir / SNAP / "flat"
    kid = Child(flat.mem_path)
    try:
        assert kid.sha() == src.sha()  # the parent's memory as the snapshot holds it
    finally:
        kid.kill()
    # in the repository at once, and what a fetch of it checks
    repo = forks.memory.repo
    for name in ("base.mem", "base.dev", "base.json"):
        key = f"memory/{SNAP}/flat/{name}"
        assert repo.has_file(key), key
        assert sha[f"{SNAP}/flat/{name}"] == hashlib.sha256(
            (flat.dir / name).read_bytes()).hexdigest()
    assert forks.use(SNAP, snap, 1)  # made: a lone start (a resume) maps it too


async def test_a_failed_image_leaves_nothing(
        node: tuple[ForkImages, BaseImage, MemSnapshot, Child],
        monkeypatch: pytest.MonkeyPatch) -> None:
    forks, base, snap, _ = node

    async def unreachable(own_dir: Path) -> dict[str, str | None]:
        raise RepositoryError("the repository is unreachable")

    monkeypatch.setattr(forks.memory, "upload", unreachable)
    with pytest.raises(ForkImageError, match="unreachable"):
        await forks.image(SNAP, base, snap)
    assert forks.made == 0 and not (forks.memory.dir / SNAP / "flat").exists()
    assert not forks.use(SNAP, snap, 1)
    monkeypatch.undo()
    flat, _, _ = await forks.image(SNAP, base, snap)  # the next fork makes it
    assert forks.made == 1 and BaseImage.load(flat.dir) == flat


async def test_a_fork_whose_image_cannot_be_made_restores_the_chain(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Through `starts.start` on a node without VMs (fakenode.py): the image of a fork's
    snapshot cannot be made (its diff here is not a diff: memsnap refuses it); the children
    still start, each restoring the snapshot's chain as before, and no image is left."""
    repo = f"posix_fs:{tmp_path / 'repo'}"
    t = await publish_template(tmp_path, repo, "tpl", mib=1)
    p = fake_node(tmp_path / "node", repo, GatedDriver())
    await starts.start(p, "parent", ref(t), NET, reboot=False)
    snap = await snapshot(p, "parent", "fork-snap", stop=False, memory=True)
    # the fake's diff is 4 KiB: take the shared path whatever its size
    p.forks.use = lambda *_: True  # type: ignore[method-assign]
    await asyncio.gather(*(starts.start(p, k, snap, NET, reboot=False, fanout=2)
                           for k in ("kid0", "kid1")))
    for k in ("kid0", "kid1"):
        sb = p.sandboxes[k]
        assert sb.memsnap_dir is not None and sb.base_dir == p.memory.dir / "tpl" / "base"
        assert "flatten_s" not in sb.timings
    assert p.forks.made == 0 and not (p.memory.dir / "fork-snap" / "flat").exists()
    assert sum("restoring the chain of fork-snap instead" in r.getMessage()
               for r in caplog.records) == 2
    for k in ("kid0", "kid1", "parent"):
        await kill(p, k)
