"""A paused sandbox resumes on another node from an `oss` repository alone: node A (its own
state dir) builds a template into a real S3-compatible server process (moto), runs a
sandbox, pauses it, shuts down, and its whole state dir is deleted; node B (new state dir,
empty memory dir, empty bounded chunk cache) resumes it: the file and the process are
there. B then pauses it again (the memory diff chain continues on B with parents fetched
from the repository) and a second node-B sandbox starts from that pause.

Own namespace prefix `aoss-` and pool 10.218.0.0/20, so the session runtime's networks
(aenv-, 10.200.0.0/16) are never touched."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import boto3  # type: ignore[import-untyped]
import pytest

from host.contract import MachineSpec, SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime, RuntimeConfig
from host.storage.repository import open_repository

from .conftest import MEM_MB, _need_vm
from .helpers import assert_gone, background, read, run, write

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

NET = NetworkConfig()
CACHE_MIB = 128
MEMORY_CACHE_MIB = 64  # smaller than one template's base.mem: every unpinned dir goes


def _cfg(root: Path, tag: str, repo: str) -> RuntimeConfig:
    return RuntimeConfig(state_dir=root / tag, run_dir=Path(f"/tmp/aoss-{tag}-{os.getpid()}"),
                         repository=repo, cache_dir=root / f"{tag}-cache", cache_mib=CACHE_MIB,
                         memory_cache_mib=MEMORY_CACHE_MIB,
                         vms_survive_service=False, network_prefix="aoss-",
                         network_pool="10.218.0.0/20",
                         network=os.environ.get("AENV_TEST_NETWORK", "auto"))


@pytest.fixture
async def oss_repo(moto_endpoint: str, s3_env: dict[str, str]) -> AsyncIterator[str]:
    _need_vm()
    bucket = f"r{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    yield f"oss://{bucket}/aenv?endpoint={moto_endpoint}&region=us-east-1"


def _du(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


async def test_resume_on_a_fresh_node_from_oss(oss_repo: str, tmp_path: Path) -> None:
    a_cfg = _cfg(tmp_path, "a", oss_repo)
    a = await NodeRuntime(a_cfg).open()
    try:
        tpl = await a.build_template("tpl-oss", MachineSpec(cpu_count=1, memory_mb=MEM_MB))
        print(f"\nnode A template build: {a.last_timings}")
        p = await a.start("oss1", tpl, NET)
        pid = await background(p, "sleep 100000")
        await write(p, "/home/user/survives.txt", "written on node A")
        await run(p, "echo inram > /dev/shm/ram")
        paused = await a.snapshot("oss1", "oss1-p1", stop=True)
        print(f"node A pause: {a.last_timings}")
        await assert_gone(a, "oss1")
    finally:
        await a.shutdown()
        shutil.rmtree(a_cfg.run_dir, ignore_errors=True)
    shutil.rmtree(a_cfg.state_dir)  # node A and everything it kept locally are gone

    # the repository alone holds the snapshot: manifest, layers and memory files
    repo = open_repository(oss_repo)
    files = paused.facts["memory"]["files"]
    assert any(f.endswith("base.mem") for f in files) and any("oss1-p1/" in f for f in files)
    assert all(repo.has_file("memory/" + f) for f in files)

    b_cfg = _cfg(tmp_path, "b", oss_repo)
    b = await NodeRuntime(b_cfg).open()
    try:
        ref = SnapshotRef("oss1-p1", paused.machine, paused.created_at, paused.parent_id, {})
        p = await b.start("oss1", ref, NET)
        timings = p.facts["timings"]
        print(f"node B resume (empty caches): {timings}")
        assert timings["fetch_memory_s"] > 0
        assert await read(p, "/home/user/survives.txt") == "written on node A"
        assert (await run(p, f"cat /dev/shm/ram; kill -0 {pid} && echo alive")).split() == [
            "inram", "alive"]
        assert (b_cfg.memory_dir / "tpl-oss" / "base" / "base.mem").is_file()
        # the disk came through the bounded chunk cache
        assert 0 < _du(b_cfg.chunk_cache_dir) <= CACHE_MIB << 20

        # the chain continues on B: a pause whose parents were fetched, then a second
        # sandbox from it (its diff is in the repository too)
        await write(p, "/home/user/second.txt", "written on node B")
        again = await b.snapshot("oss1", "oss1-p2", stop=False)
        assert all(repo.has_file("memory/" + f) for f in again.facts["memory"]["files"])
        q = await b.start("oss2", again, NET)
        assert await read(q, "/home/user/second.txt") == "written on node B"
        assert await read(q, "/home/user/survives.txt") == "written on node A"
        await b.kill("oss2")
        await assert_gone(b, "oss2")
        await b.kill("oss1")

        # memory/ is a bounded cache: a start pins only what it uses, the rest (committed,
        # in the repository) is evicted, and fetched again when needed
        r = await b.start("oss3", tpl, NET)
        assert {d.name for d in b_cfg.memory_dir.iterdir()
                if not d.name.startswith(".")} == {"tpl-oss"}
        await b.kill("oss3")
        r = await b.start("oss4", again, NET)
        assert r.facts["timings"]["fetch_memory_s"] > 0
        assert await read(r, "/home/user/second.txt") == "written on node B"
        await b.kill("oss4")

        # deleting the snapshots removes from the repository the memory node B uploaded;
        # node A's (oss1-p1) is A's to delete, and the template's stays while a manifest
        # uses it
        await b.delete_snapshot("oss1-p2")
        await b.delete_snapshot("oss1-p1")
        assert not any(repo.has_file("memory/" + f) for f in again.facts["memory"]["files"]
                       if f.startswith("oss1-p2/"))
        assert all(repo.has_file("memory/" + f) for f in again.facts["memory"]["files"]
                   if f.startswith("oss1-p1/"))
        assert all(repo.has_file("memory/" + f) for f in tpl.facts["memory"]["files"])
    finally:
        await b.shutdown()
        shutil.rmtree(b_cfg.run_dir, ignore_errors=True)
