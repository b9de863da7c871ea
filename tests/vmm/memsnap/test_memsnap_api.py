"""The high-level API (snapshot_incremental / restore_into) host-only: helper processes stand
in for QEMU's RAM mapping and a fake QMP client records the command sequence."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from host.vmm.memsnap import (
    BaseImage,
    CaptureBuffer,
    CorruptSnapshotError,
    MemSnapError,
    MemSnapshot,
    flatten_base,
    restore_base_into,
    restore_into,
    snapshot_incremental,
)

from .memsnap_helpers import PAGE, Child, make_base
from .test_memsnap_devstate import template, xen

CFG = hashlib.sha256(b"cfg").digest()


class FakeQmp:
    """Answers the QMP commands memsnap sends; records them in ``log``."""

    def __init__(self, status: str) -> None:
        self.status = status
        self.log: list[str] = []
        self._pending: int | None = None  # an fd sent ahead of add-fd (SCM_RIGHTS)
        self._fdsets: dict[int, int] = {}

    def send_fd_scm(self, fd: int) -> None:
        self._pending = os.dup(fd)

    async def execute(self, cmd: str, args: dict[str, Any] | None = None) -> Any:
        self.log.append(cmd)
        if cmd == "query-version":
            return {"qemu": {"major": 10, "minor": 0, "micro": 2}}
        if cmd == "add-fd":
            assert self._pending is not None, "add-fd without a descriptor"
            fdset = len(self._fdsets) + 1
            self._fdsets[fdset], self._pending = self._pending, None
            return {"fdset-id": fdset, "fd": 99}
        if cmd == "remove-fd":
            assert args is not None
            os.close(self._fdsets.pop(args["fdset-id"]))
            return {}
        if cmd == "query-status":
            return {"status": self.status}
        if cmd == "stop":
            self.status = "paused"
        elif cmd == "cont":
            self.status = "running"
        elif cmd == "xen-save-devices-state":
            assert args is not None
            # memsnap hands QEMU a descriptor it opened: QEMU never opens a host path
            assert args["filename"].startswith("/dev/fdset/"), args
            os.write(self._fdsets[int(args["filename"].rsplit("/", 1)[1])], xen())
        elif cmd == "migrate-incoming":
            self.status = "paused"
        elif cmd == "query-migrate":
            return {"status": "completed"}
        return {}


@pytest.fixture
def base(tmp_path: Path) -> BaseImage:
    d = tmp_path / "base"
    d.mkdir()
    mem = make_base(d / "base.mem", 1024, list(range(0, 1024, 5)))
    (d / "base.dev").write_bytes(template())
    sha = hashlib.sha256(mem.read_bytes()).digest()
    (d / "base.json").write_text(json.dumps(
        {"mem": "base.mem", "template": "base.dev", "sha256": sha.hex(), "size": 1024 * PAGE}))
    return BaseImage.load(d)


async def test_snapshot_chain_and_restore(base: BaseImage, tmp_path: Path, children: list[Child]) -> None:
    src = Child(base.mem_path)
    children.append(src)
    rng = random.Random(5)
    qmp = FakeQmp("running")
    buf = CaptureBuffer()  # reused by the three snapshots, like a driver's VM object would
    src.write("one", sorted(rng.sample(range(1024), 100)))
    s1 = await snapshot_incremental(qmp, src.pid, base.mem_path, base, tmp_path / "s1",
                                    config_sha256=CFG, buffer=buf)
    mm = buf.reserve(1)
    assert qmp.log == ["query-status", "stop", "add-fd", "xen-save-devices-state", "remove-fd",
                       "cont"]
    assert qmp.status == "running" and s1.stats["diff_pages"] == 100
    assert s1.stats["downtime_ms"] <= s1.stats["total_ms"]
    sha1 = src.sha()

    src.write("two", sorted(rng.sample(range(1024), 30)))
    s2 = await snapshot_incremental(FakeQmp("running"), src.pid, base.mem_path, base, tmp_path / "s2",
                                    config_sha256=CFG, parent=s1, buffer=buf)
    assert buf.reserve(1) is mm
    assert len(s2.diffs) == 2 and s2.stats["diff_pages"] == 30  # content delta only
    sha2 = src.sha()
    src.write("three", [7])
    s3 = await snapshot_incremental(FakeQmp("paused"), src.pid, base.mem_path, base, tmp_path / "s3",
                                    config_sha256=CFG, parent=s2, max_chain=2, buffer=buf)
    buf.close()
    assert len(s3.diffs) == 1  # compacted: a cumulative diff instead of a third level
    assert s3.stats["diff_pages"] == s3.stats["captured_pages"]
    sha3 = src.sha()

    for snap, want in ((s1, sha1), (MemSnapshot.load(tmp_path / "s2"), sha2), (s3, sha3)):
        dst = Child(base.mem_path)
        children.append(dst)
        q = FakeQmp("inmigrate")
        st = await restore_into(q, dst.pid, base.mem_path, snap, base, config_sha256=CFG)
        assert q.log[0] == "query-status" and q.log[-1] == "cont" and "migrate-incoming" in q.log
        assert dst.sha() == want and st.pages > 0


async def test_restore_refuses_bad_input_before_touching_the_vm(
    base: BaseImage, tmp_path: Path, children: list[Child]
) -> None:
    src = Child(base.mem_path)
    dst = Child(base.mem_path)
    children += [src, dst]
    src.write("x", [1, 2, 3])
    snap = await snapshot_incremental(FakeQmp("running"), src.pid, base.mem_path, base, tmp_path / "s",
                                      config_sha256=CFG)
    before = dst.sha()
    with pytest.raises(MemSnapError, match="-incoming defer"):
        await restore_into(FakeQmp("running"), dst.pid, base.mem_path, snap, base)
    raw = bytearray(snap.devstate.read_bytes())
    raw[20] ^= 1
    snap.devstate.write_bytes(bytes(raw))
    q = FakeQmp("inmigrate")
    with pytest.raises(CorruptSnapshotError, match="device state checksum"):
        await restore_into(q, dst.pid, base.mem_path, snap, base)
    assert q.log == [] and dst.sha() == before
    (tmp_path / "s" / "snapshot.json").write_text("{")
    with pytest.raises(CorruptSnapshotError, match="manifest"):
        MemSnapshot.load(tmp_path / "s")


async def test_flatten_keeps_holes_and_hashes_what_it_wrote(tmp_path: Path,
                                                            children: list[Child]) -> None:
    """4 MiB of RAM: base data in the first MiB only; the chain writes into the first and
    the third. The flat file holds base + chain page for page, its sha256 is the content's,
    and the MiB neither touched (the fourth) is still a hole on disk."""
    d = tmp_path / "sparse"
    d.mkdir()
    mem = make_base(d / "base.mem", 1024, list(range(256)))
    (d / "base.dev").write_bytes(template())
    sha = hashlib.sha256(mem.read_bytes()).digest()
    (d / "base.json").write_text(json.dumps(
        {"mem": "base.mem", "template": "base.dev", "sha256": sha.hex(), "size": 1024 * PAGE}))
    base = BaseImage.load(d)
    src = Child(base.mem_path)
    children.append(src)
    src.write("w", [3, 100, 600, 601, 700])
    snap = await snapshot_incremental(FakeQmp("running"), src.pid, base.mem_path, base,
                                      tmp_path / "s", config_sha256=CFG)
    new = flatten_base(snap, base, tmp_path / "flat")
    kid = Child(new.mem_path)
    children.append(kid)
    assert kid.sha() == src.sha()
    assert hashlib.sha256(new.mem_path.read_bytes()).digest() == new.sha256
    fd = os.open(new.mem_path, os.O_RDONLY)
    try:
        assert os.lseek(fd, 512 * PAGE, os.SEEK_DATA) == 512 * PAGE  # the chain's MiB
        with pytest.raises(OSError):  # ENXIO: nothing but a hole from the fourth MiB on
            os.lseek(fd, 768 * PAGE, os.SEEK_DATA)
    finally:
        os.close(fd)
    assert not list(tmp_path.glob("flat/.*"))  # no temporary file left


async def test_flatten_into_a_new_base(base: BaseImage, tmp_path: Path, children: list[Child]) -> None:
    src = Child(base.mem_path)
    children.append(src)
    src.write("f", list(range(100, 400)))
    snap = await snapshot_incremental(FakeQmp("running"), src.pid, base.mem_path, base, tmp_path / "s",
                                      config_sha256=CFG)
    new = flatten_base(snap, base, tmp_path / "base2")
    assert new.sha256 != base.sha256 and BaseImage.load(tmp_path / "base2") == new
    assert new.mem_path.stat().st_mode & 0o777 == 0o444
    assert new.template_path.read_bytes() == snap.devstate.read_bytes()
    kid = Child(new.mem_path)
    children.append(kid)
    q = FakeQmp("inmigrate")
    await restore_base_into(q, kid.pid, new.mem_path, new)
    assert q.log[-1] == "cont" and kid.sha() == src.sha()
    # diffs against the new base start empty again
    s2 = await snapshot_incremental(FakeQmp("running"), kid.pid, new.mem_path, new, tmp_path / "s2",
                                    config_sha256=CFG)
    assert s2.stats["diff_pages"] == 0
    with pytest.raises(MemSnapError, match="does not belong"):
        flatten_base(s2, base, tmp_path / "base3")
