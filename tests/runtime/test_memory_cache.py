"""The node's memory cache against a real S3 server process (moto), no VM (fakenode.py):
a start's memory files are pinned from their fetch until its VM maps them, so another
start's trim under a tiny bound cannot evict them (issue 14 item 25), pins are released
on every way out; fetched memory files are checked against the sha256 recorded at upload,
refetched once, and never handed to a VM or left in memory/ when damaged (item 24)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest

from host.contract import NetworkConfig
from host.runtime import SnapshotCorruptError, starts
from host.runtime.adoption import kill
from host.runtime.errors import SandboxStartError
from host.runtime.memory import MEMORY_KEY
from host.runtime.snapshots import snapshot
from host.storage.repository import OssRepository
from host.vmm.errors import VmmStartError

from .fakenode import GatedDriver, fake_node, publish_template, ref

pytestmark = pytest.mark.asyncio(loop_scope="session")

NET = NetworkConfig()


@pytest.fixture
def oss_spec(moto_endpoint: str, s3_env: dict[str, str]) -> Iterator[str]:
    bucket = f"m{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    yield f"oss://{bucket}/aenv?endpoint={moto_endpoint}&region=us-east-1"


def _local(p: Any, snapshot_id: str) -> list[str]:
    d = p.memory.dir / snapshot_id
    return sorted(f.relative_to(d).as_posix() for f in d.rglob("*")) if d.exists() else []


# -- item 25: pins ------------------------------------------------------------------------

async def test_a_start_keeps_its_files_through_another_starts_trim(
        oss_spec: str, tmp_path: Path) -> None:
    a = await publish_template(tmp_path, oss_spec, "tpl-a", mib=2)
    b = await publish_template(tmp_path, oss_spec, "tpl-b", mib=2)
    driver = GatedDriver()
    # 1 MiB: less than either base, so every trim evicts all it may
    p = fake_node(tmp_path / "node", oss_spec, driver, memory_cache_mib=1)
    driver.gates["sbx-a"] = asyncio.Event()
    start_a = asyncio.create_task(starts.start(p, "sbx-a", ref(a), NET, reboot=False))
    try:
        await asyncio.wait_for(driver.entered["sbx-a"].wait(), 30)  # fetched, restoring
        await starts.start(p, "sbx-b", ref(b), NET, reboot=False)   # ends with its trim
        assert "base/base.mem" in _local(p, "tpl-a")  # A's files survived B's trim
    finally:
        driver.gates["sbx-a"].set()
        await asyncio.wait({start_a}, timeout=30)
    await start_a
    assert driver.seen["sbx-a"] == a["memory"]["sha256"]["tpl-a/base/base.mem"]
    assert set(p.sandboxes) == {"sbx-a", "sbx-b"} and not p.memory.pins
    # both are live, so a trim keeps both; once A is gone its files may go
    await p.trim_memory()
    assert _local(p, "tpl-a") and _local(p, "tpl-b")
    await kill(p, "sbx-a")
    await p.trim_memory()
    assert not _local(p, "tpl-a") and _local(p, "tpl-b")


async def test_pins_are_released_on_failure_and_cancellation(
        oss_spec: str, tmp_path: Path) -> None:
    a = await publish_template(tmp_path, oss_spec, "tpl-a", mib=2)
    driver = GatedDriver()
    p = fake_node(tmp_path / "node", oss_spec, driver, memory_cache_mib=1)
    driver.fail_once["restore_memory"] = VmmStartError("boom")
    with pytest.raises(SandboxStartError, match="boom"):
        await starts.start(p, "sbx-f", ref(a), NET, reboot=False)
    assert not p.memory.pins and not p.sandboxes and not p.busy
    assert not p.block.client.stacks
    driver.gates["sbx-c"] = asyncio.Event()
    task = asyncio.create_task(starts.start(p, "sbx-c", ref(a), NET, reboot=False))
    await asyncio.wait_for(driver.entered["sbx-c"].wait(), 30)
    assert p.memory.pins == {"tpl-a": 1}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not p.memory.pins and not p.sandboxes and not p.block.client.stacks
    await p.trim_memory()  # nothing holds them any more
    assert not _local(p, "tpl-a")


async def test_trim_asks_again_for_pins_after_each_await(oss_spec: str,
                                                         tmp_path: Path) -> None:
    """A start that pins a dir while trim awaits the repository keeps it."""
    a = await publish_template(tmp_path, oss_spec, "tpl-a", mib=2)
    b = await publish_template(tmp_path, oss_spec, "tpl-b", mib=2)
    p = fake_node(tmp_path / "node", oss_spec, GatedDriver(), memory_cache_mib=1)
    await p.memory.fetch(a)
    await p.memory.fetch(b)
    os.utime(p.memory.dir / "tpl-a", (1, 1))  # the least recently used
    held = []

    async def committed(snapshot_id: str) -> bool:
        if snapshot_id == "tpl-a":  # a start of tpl-a begins meanwhile
            held.append(p.memory.pin({"tpl-a"}))
            held[-1].__enter__()
        return True

    await p.memory.trim(p.pinned_memory, committed)
    assert _local(p, "tpl-a") and not _local(p, "tpl-b")
    held[0].__exit__(None, None, None)
    assert not p.memory.pins


# -- item 24: damaged memory files ----------------------------------------------------------

def _damage(repo: OssRepository, key: str, size: int, tmp: Path) -> None:
    """Replace a stored file by another of the same size (a valid compressed object)."""
    other = tmp / f"other-{uuid.uuid4().hex[:6]}"
    other.write_bytes(os.urandom(size))
    repo.put_file(key, other)


async def test_damaged_memory_file_is_refused_and_not_cached(oss_spec: str,
                                                             tmp_path: Path) -> None:
    a = await publish_template(tmp_path, oss_spec, "tpl-a", mib=2)
    driver = GatedDriver()
    p = fake_node(tmp_path / "node", oss_spec, driver)
    repo = p.memory.repo
    assert isinstance(repo, OssRepository)
    _damage(repo, MEMORY_KEY + "tpl-a/base/base.mem", 2 << 20, tmp_path)
    with pytest.raises(SnapshotCorruptError, match=r"base\.mem .*damaged") as err:
        await starts.start(p, "sbx-a", ref(a), NET, reboot=False)
    assert "sha256" in str(err.value)
    assert "base/base.mem" not in _local(p, "tpl-a")  # nothing of it kept
    assert not [f for f in p.memory.dir.rglob("*") if f.name.startswith(".tmp")]
    assert ("restore_memory", "sbx-a") not in driver.calls  # never reached a VM
    assert not p.block.client.stacks and not p.memory.pins


class FlakyS3:
    """The repository's S3 client, except that the first `times` downloads of `key` get
    the bytes of `bad_key` (a transfer that went wrong)."""

    def __init__(self, s3: Any, key: str, bad_key: str, times: int) -> None:
        self.s3, self.key, self.bad_key, self.left = s3, key, bad_key, times

    def __getattr__(self, name: str) -> Any:
        return getattr(self.s3, name)

    def download_fileobj(self, bucket: str, key: str, fileobj: Any, **kw: Any) -> None:
        if key == self.key and self.left > 0:
            self.left -= 1
            key = self.bad_key
        self.s3.download_fileobj(bucket, key, fileobj, **kw)


async def test_a_bad_transfer_is_fetched_again(oss_spec: str, tmp_path: Path) -> None:
    a = await publish_template(tmp_path, oss_spec, "tpl-a", mib=2)
    driver = GatedDriver()
    p = fake_node(tmp_path / "node", oss_spec, driver)
    repo = p.memory.repo
    assert isinstance(repo, OssRepository)
    good = repo._file_key(MEMORY_KEY + "tpl-a/base/base.mem")
    _damage(repo, MEMORY_KEY + "junk/base.mem", 2 << 20, tmp_path)
    repo.s3 = FlakyS3(repo.s3, good, repo._file_key(MEMORY_KEY + "junk/base.mem"), times=1)
    await starts.start(p, "sbx-a", ref(a), NET, reboot=False)
    want = a["memory"]["sha256"]["tpl-a/base/base.mem"]
    assert driver.seen["sbx-a"] == want and repo.s3.left == 0
    # twice bad: refused
    p2 = fake_node(tmp_path / "node2", oss_spec, driver)
    repo2 = p2.memory.repo
    assert isinstance(repo2, OssRepository)
    repo2.s3 = FlakyS3(repo2.s3, good, repo2._file_key(MEMORY_KEY + "junk/base.mem"), times=2)
    with pytest.raises(SnapshotCorruptError, match="fetched twice"):
        await starts.start(p2, "sbx-b", ref(a), NET, reboot=False)
    assert "base/base.mem" not in _local(p2, "tpl-a")


async def test_a_pause_records_the_sha256_of_every_memory_file(oss_spec: str,
                                                               tmp_path: Path) -> None:
    a = await publish_template(tmp_path, oss_spec, "tpl-a", mib=1)
    p = fake_node(tmp_path / "node", oss_spec, GatedDriver())
    await starts.start(p, "sbx-a", ref(a), NET, reboot=False)
    ref_p = await snapshot(p, "sbx-a", "snap-p", stop=True, memory=True)
    mem = ref_p.facts["memory"]
    local = p.memory.dir
    want = {n: hashlib.sha256((local / n).read_bytes()).hexdigest()
            for n in mem["files"] if n.startswith("snap-p/")}
    assert len(want) == 3  # diff, device state, snapshot.json
    # its own files as uploaded, the template's as the template recorded them
    assert mem["sha256"] == {**a["memory"]["sha256"], **want}
    assert set(mem["sha256"]) == set(mem["files"])
    # another node resumes it, each file checked against what the pause recorded ...
    driver = GatedDriver()
    p2 = fake_node(tmp_path / "node2", oss_spec, driver)
    await starts.start(p2, "sbx-b", ref_p, NET, reboot=False)
    assert ("restore_memory", "sbx-b") in driver.calls
    # ... so a damaged diff of the pause is refused on a third
    repo = p.memory.repo
    assert isinstance(repo, OssRepository)
    _damage(repo, MEMORY_KEY + "snap-p/mem/mem.diff", 4096, tmp_path)
    p3 = fake_node(tmp_path / "node3", oss_spec, GatedDriver())
    with pytest.raises(SnapshotCorruptError, match=r"snap-p/mem/mem\.diff .*damaged"):
        await starts.start(p3, "sbx-c", ref_p, NET, reboot=False)
    assert not (p3.memory.dir / "snap-p" / "mem" / "mem.diff").exists()
