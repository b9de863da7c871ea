"""Collection in a repository two nodes share (host/runtime/holds.py), posix_fs and oss
(a real moto server process), each node with its own real block server: a node deletes
only the repository copies of layers it made, never while another node's stack holds
them, and not before that node published its holdings after the layer was found
unreferenced; a node gone (holdings older than `node_expiry_s`) is not waited for.
No VM is booted: the stacks are what a start would make."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import boto3
import pytest

from host.runtime import holds
from host.runtime.blockd import BlockServerHandle
from host.runtime.collect import collect
from host.runtime.compaction import Compactor
from host.runtime.config import RuntimeConfig
from host.runtime.forkimages import ForkImages
from host.runtime.machines import Machines
from host.runtime.manifests import ManifestStore
from host.runtime.memory import MemoryFiles
from host.runtime.parts import NodeParts
from host.storage.repository import open_repository

pytestmark = pytest.mark.asyncio(loop_scope="function")
MiB = 1 << 20


@pytest.fixture(params=["posix_fs", "oss"])
async def shared(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "posix_fs":
        yield f"posix_fs:{tmp_path / 'shared'}"
        return
    endpoint = request.getfixturevalue("moto_endpoint")
    request.getfixturevalue("s3_env")
    bucket = f"g{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    yield f"oss://{bucket}/aenv?endpoint={endpoint}&region=us-east-1"


@pytest.fixture(autouse=True)
def _run_dirs() -> Iterator[None]:
    """The nodes' run dirs (short /tmp paths: unix sockets live there) go with the test."""
    yield
    for d in Path("/tmp").glob(f"agc-*-{os.getpid()}"):
        shutil.rmtree(d, ignore_errors=True)


async def _node(root: Path, name: str, repo: str) -> NodeParts:
    cfg = RuntimeConfig(state_dir=root / name, run_dir=Path(f"/tmp/agc-{name}-{os.getpid()}"),
                        repository=repo, cache_dir=root / f"{name}-cache", cache_mib=64,
                        node_id=name, node_clock_skew_s=0.0)
    for d in (cfg.state_dir, cfg.memory_dir, cfg.run_dir):
        d.mkdir(parents=True, exist_ok=True)
    block = BlockServerHandle(cfg)
    await block.ensure()
    manifests = ManifestStore(cfg.repository_spec)
    memory = MemoryFiles(cfg.memory_dir, manifests.repo, bound_mib=64)
    return NodeParts(config=cfg, block=block, machines=Machines(cfg, block), memory=memory,
                     manifests=manifests, compactor=Compactor(block, 0),
                     forks=ForkImages(memory, min_mib=0))


async def _layer(p: NodeParts, stack: str, byte: int) -> str:
    """A sealed layer made on node `p`, pushed to the repository, named by nothing."""
    await p.block.client.create(stack, virtual_size=MiB)
    uri = f"nbd+unix:///{stack}?socket={p.block.nbd_socket}"
    await asyncio.to_thread(subprocess.run, ["qemu-io", "-f", "raw", "-c",
                                             f"write -P {byte} 0 64k", uri],
                            check=True, capture_output=True, timeout=60)
    digest = await p.block.client.seal(stack)  # uploads
    await p.block.client.delete(stack)
    return digest


def _local(p: NodeParts, digest: str) -> bool:
    return (p.config.layers_dir / f"{digest[7:]}.lsmt").exists()


async def test_a_node_deletes_only_its_own_layers_once_no_node_holds_them(
        shared: str, tmp_path: Path) -> None:
    a, b = await _node(tmp_path, "na", shared), await _node(tmp_path, "nb", shared)
    repo = open_repository(shared)
    try:
        mine, theirs = await _layer(a, "la", 1), await _layer(b, "lb", 2)
        await holds.publish(b)  # b holds nothing yet
        # b stacks a's layer: a start there that read a manifest deleted since
        await b.block.client.create("sbx-b", [mine])
        first = await collect(a, min_age_s=0)
        # unreferenced, but b's holdings are older than that finding: it waits a phase
        assert first["layers"]["files"] == 0 and _local(a, mine) and repo.has_layer(mine)
        assert first["waiting_layers"] == 1
        await holds.publish(b)  # now they name it
        held = await collect(a, min_age_s=0)
        assert held["layers"]["files"] == 0 and repo.has_layer(mine)
        await b.block.client.delete("sbx-b")
        await asyncio.sleep(0.01)
        await holds.publish(b)  # no longer held...
        found = await collect(a, min_age_s=0)  # ...found unreferenced now: a phase to wait
        assert found["layers"]["files"] == 0 and repo.has_layer(mine)
        # a dry run counts it as waiting, not as collectable, and starts no phase
        dry = await collect(a, min_age_s=0, dry_run=True)
        assert dry["layers"]["files"] == 0 and dry["waiting_layers"] == 1
        await asyncio.sleep(0.01)
        await holds.publish(b)
        dry = await collect(a, min_age_s=0, dry_run=True)
        assert dry["layers"]["digests"] == [mine[7:]] and dry["waiting_layers"] == 0
        assert _local(a, mine) and repo.has_layer(mine)
        gone = await collect(a, min_age_s=0)
        assert gone["layers"]["digests"] == [mine[7:]]
        assert gone["repository_layers"]["digests"] == [mine[7:]]
        assert not _local(a, mine) and not repo.has_layer(mine)
        # b's layer is named by nothing either: a never touches it, b collects it itself
        assert repo.has_layer(theirs) and _local(b, theirs)
        await asyncio.sleep(0.01)
        await holds.publish(a)
        await collect(b, min_age_s=0)
        await asyncio.sleep(0.01)
        await holds.publish(a)
        out = await collect(b, min_age_s=0)
        assert out["repository_layers"]["digests"] == [theirs[7:]]
        assert not repo.has_layer(theirs)
    finally:
        for p in (a, b):
            await p.block.stop()


async def test_a_node_gone_is_not_waited_for(shared: str, tmp_path: Path) -> None:
    a = await _node(tmp_path, "na", shared)
    repo = open_repository(shared)
    try:
        mine = await _layer(a, "la", 3)
        # a node that stopped publishing two hours ago; its holdings named this layer
        await a.manifests.put_doc("gcheld-ghost", {"node": "ghost", "updated_at":
                                                   time.time() - 7200, "layers": [mine]})
        out = await collect(a, min_age_s=0)
        assert out["repository_layers"]["digests"] == [mine[7:]] and not repo.has_layer(mine)
        # a node alive and holding it is a root, however long ago it found it
        again = await _layer(a, "la2", 4)
        await a.manifests.put_doc("gcheld-live", {"node": "live", "updated_at": time.time(),
                                                  "layers": [again]})
        kept = await collect(a, min_age_s=0)
        assert kept["layers"]["files"] == 0 and repo.has_layer(again)
    finally:
        await a.block.stop()


async def test_a_node_deletes_only_the_memory_it_uploaded(shared: str, tmp_path: Path) -> None:
    """Memory in a shared repository: a node's collection removes the repository copy of
    the snapshots' memory it uploaded once nothing uses it, even after its local copy
    went (the ledger outlives the cache), never another node's."""
    repo = open_repository(shared)
    a = MemoryFiles(tmp_path / "a-memory", repo, bound_mib=64)
    b = MemoryFiles(tmp_path / "b-memory", open_repository(shared), bound_mib=64)
    for files, sid in ((a, "snap-a"), (a, "snap-kept"), (b, "snap-b")):
        own = files.dir / sid / "mem"
        own.mkdir(parents=True)
        (own / "mem.diff").write_bytes(os.urandom(4096))
        await files.upload(own)
    await a.gc(set())  # a's local copies go (a trim would do the same): not its ledger
    assert not (a.dir / "snap-a").exists()
    assert a.uploaded({"snap-a", "snap-b", "snap-kept"}) == {"snap-a", "snap-kept"}
    dry = await a.gc_remote({"snap-kept"}, min_age_s=0, dry_run=True)
    assert dry.digests == ["snap-a"] and repo.has_file("memory/snap-a/mem/mem.diff")
    out = await a.gc_remote({"snap-kept"}, min_age_s=0)
    assert out.digests == ["snap-a"] and out.bytes >= 4096
    assert not repo.has_file("memory/snap-a/mem/mem.diff")
    assert repo.has_file("memory/snap-kept/mem/mem.diff")  # still used
    assert repo.has_file("memory/snap-b/mem/mem.diff")  # b's: never a's to delete
    assert (await a.gc_remote(set(), min_age_s=3600)).files == 0  # too young


async def _memory(p: NodeParts, sid: str) -> str:
    """Memory of snapshot `sid` uploaded by node `p` (its ledger records it); its key."""
    own = p.memory.dir / sid / "mem"
    own.mkdir(parents=True)
    (own / "mem.diff").write_bytes(os.urandom(4096))
    await p.memory.upload(own)
    return f"memory/{sid}/mem/mem.diff"


async def _age(p: NodeParts, node: str, by_s: float) -> None:
    """Make node `node`'s holdings look `by_s` seconds old (it stopped publishing)."""
    doc = await p.manifests.get_doc(f"gcheld-{node}")
    assert doc is not None
    await p.manifests.put_doc(f"gcheld-{node}", {**doc, "updated_at": doc["updated_at"] - by_s})


async def test_a_gone_nodes_objects_go_through_the_first_live_node(
        shared: str, tmp_path: Path) -> None:
    """A node that stops for good leaves its layers and memory in the repository: the live
    node first by id deletes those nothing names (not the others), then its holdings."""
    z = await _node(tmp_path, "nz", shared)
    repo = open_repository(shared)
    try:
        dropped, named = await _layer(z, "lz1", 5), await _layer(z, "lz2", 6)
        dropped_mem, named_mem = await _memory(z, "snap-z1"), await _memory(z, "snap-z2")
        await z.manifests.put("snap-z2", {"disk": {"layers": [named]}})  # a manifest
        await holds.publish(z)
        doc = await z.manifests.get_doc("gcheld-nz")
        assert doc is not None and set(doc["made"]) == {dropped[7:], named[7:]}
        assert doc["memory"] == ["snap-z1", "snap-z2"]
    finally:
        await z.block.stop()
    a, b = await _node(tmp_path, "na", shared), await _node(tmp_path, "nb", shared)
    try:
        await holds.publish(a)
        await _age(b, "nz", 7200)  # nz is gone
        out = await collect(b, min_age_s=0)  # not first by id: nz's are not b's to delete
        assert out["repository_layers"]["files"] == 0 and repo.has_layer(dropped)
        assert out["repository_memory"]["files"] == 0 and repo.has_file(dropped_mem)
        # a layer found now waits for b's holdings; memory (no holdings name it) goes
        first = await collect(a, min_age_s=0)
        assert first["waiting_layers"] == 1 and repo.has_layer(dropped)
        assert first["repository_memory"]["digests"] == ["snap-z1"]
        assert not repo.has_file(dropped_mem) and repo.has_file(named_mem)
        await asyncio.sleep(0.01)
        await holds.publish(b)
        dry = await collect(a, min_age_s=0, dry_run=True)
        assert dry["repository_layers"]["digests"] == [dropped[7:]] and repo.has_layer(dropped)
        out = await collect(a, min_age_s=0)
        assert out["repository_layers"]["digests"] == [dropped[7:]]
        assert not repo.has_layer(dropped)
        assert repo.has_layer(named) and repo.has_file(named_mem)  # a manifest names them
        doc = await a.manifests.get_doc("gcheld-nz")
        assert doc is not None and doc["made"] == [named[7:]] and doc["memory"] == ["snap-z2"]
        await a.manifests.delete_doc("snapshot-snap-z2")  # nothing names them now
        await collect(a, min_age_s=0)
        await asyncio.sleep(0.01)
        await holds.publish(b)
        last = await collect(a, min_age_s=0)
        assert last["repository_layers"]["digests"] == [named[7:]]
        assert not repo.has_layer(named) and not repo.has_file(named_mem)
        assert await a.manifests.get_doc("gcheld-nz") is None  # nothing of nz is left
    finally:
        for p in (a, b):
            await p.block.stop()


async def test_a_node_that_lost_its_state_still_deletes_what_it_made(
        shared: str, tmp_path: Path) -> None:
    """A node restarted on an empty state dir (a disk replaced, a container without its
    volume) reads its last holdings: what it made before is still its own to delete."""
    a = await _node(tmp_path, "na", shared)
    repo = open_repository(shared)
    try:
        made = await _layer(a, "la", 7)
        key = await _memory(a, "snap-a")
        await holds.publish(a)
    finally:
        await a.block.stop()
    for d in (a.config.state_dir, a.config.run_dir):
        shutil.rmtree(d)
    a = await _node(tmp_path, "na", shared)  # the same node id, nothing of its own
    try:
        assert not _local(a, made) and repo.has_layer(made) and repo.has_file(key)
        out = await collect(a, min_age_s=0)
        assert a.lost is not None
        assert out["repository_layers"]["digests"] == [made[7:]]
        assert out["repository_memory"]["digests"] == ["snap-a"]
        assert not repo.has_layer(made) and not repo.has_file(key)
        assert a.lost.layers == set() and a.lost.memory == set()
        doc = await a.manifests.get_doc("gcheld-na")  # rewritten by the collection
        assert doc is not None and doc["made"] == [] and doc["memory"] == []
    finally:
        await a.block.stop()
