"""A node runtime without VMs, for host-only tests of starts, memory pins and snapshot
manifests: the real `NodeParts`, `Machines`, `MemoryFiles` and `ManifestStore` over a real
repository (posix_fs, or the moto S3 server), with `FakeDriver` as the VMM, user-mode
networking, and a stand-in for the block server that only records stacks (no disk is
read: the fake VMs never touch one).

`publish_template` puts a template snapshot into the repository the way a build does: a
real frozen base (`install_base` over random RAM), uploaded through another node's
`MemoryFiles`, then the manifest. `GatedDriver` is the FakeDriver with a restore that
can be held (`gates`), and that, like a real VMM mapping its base, fails when the base
file is gone and reads what it maps (`seen`: the sha256 of each VM's base.mem); its VMs
write their memory snapshots as files (`WritingVm`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from host.contract import MachineSpec, SnapshotRef
from host.runtime.compaction import Compactor
from host.runtime.config import RuntimeConfig
from host.runtime.forkimages import ForkImages
from host.runtime.machines import Machines
from host.runtime.manifests import VERSION, ManifestStore
from host.runtime.memory import MemoryFiles
from host.runtime.parts import NodeParts
from host.storage.errors import StackNotFoundError
from host.vmm.driver import BootTimeouts, VmSpec, VmState
from host.vmm.errors import VmmSnapshotError
from host.vmm.fake import FakeDriver, FakeVm
from host.vmm.memsnap import BaseImage, MemSnapError, MemSnapshot
from host.vmm.memsnap.base import hash_file, install_base, verify_base
from host.vmm.memsnap.snapshot import SNAPSHOT_MANIFEST

KERNEL = "/k/vmlinux"
LAYER = "sha256:" + "ab" * 32


@dataclass
class StackInfoStub:
    layers: tuple[str, ...]
    virtual_size: int = 1 << 30


@dataclass
class FakeBlockClient:
    """The control calls the runtime makes, on a dict of stack -> layers."""

    stacks: dict[str, list[str]] = field(default_factory=dict)
    sealed: int = 0
    prehashed: list[str] = field(default_factory=list)

    async def create(self, name: str, layers: list[str]) -> None:
        self.stacks[name] = list(layers)

    async def delete(self, name: str) -> None:
        if self.stacks.pop(name, None) is None:
            raise StackNotFoundError(name)

    async def prehash(self, name: str) -> None:
        self.prehashed.append(name)

    async def seal(self, name: str, upload: bool = True) -> str:
        self.sealed += 1
        digest = "sha256:" + f"{self.sealed:064x}"
        self.stacks[name].append(digest)
        return digest

    async def push(self, digest: str) -> None:
        pass

    async def info(self, name: str) -> StackInfoStub:
        return StackInfoStub(tuple(self.stacks[name]))


@dataclass
class FakeBlock:
    client: FakeBlockClient = field(default_factory=FakeBlockClient)
    nbd_socket: Path = Path("/nonexistent/nbd.sock")

    def export_socket(self, stack: str) -> Path:
        return Path(f"/nonexistent/x/{stack}/nbd.sock")


class WritingVm(FakeVm):
    """A FakeVm whose memory snapshots are files: a random diff and device state and a
    memsnap `snapshot.json` naming them (what uploads, fetches and restores handle)."""

    async def snapshot_memory(self, dest: Path, **kw: Any) -> MemSnapshot:
        snap = await super().snapshot_memory(dest, **kw)
        dest.mkdir(parents=True, exist_ok=True)
        for f in (snap.diff, snap.devstate):
            f.write_bytes(os.urandom(4096))
        (dest / SNAPSHOT_MANIFEST).write_bytes(snap._manifest())
        return snap


class GatedDriver(FakeDriver):
    async def _launch(self, op: str, spec: VmSpec, state: VmState) -> FakeVm:
        vm = WritingVm(self, spec)
        await self._op(op, vm)
        vm._state = state
        self._vms.append(vm)
        return vm

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.seen: dict[str, str] = {}

    async def restore_memory(
        self, spec: VmSpec, *, base: BaseImage, snapshot: MemSnapshot | None = None,
        timeouts: BootTimeouts | None = None, resume: bool = True,
    ) -> FakeVm:
        self.entered[spec.name].set()
        gate = self.gates.get(spec.name)
        if gate is not None:
            await gate.wait()
        try:
            verify_base(base)  # what QEMU's restore checks: the file is there, its size
            self.seen[spec.name] = (await asyncio.to_thread(hash_file, base.mem_path)).hex()
        except (MemSnapError, OSError) as exc:
            raise VmmSnapshotError(f"{spec.name}: {exc}") from exc
        return await super().restore_memory(spec, base=base, snapshot=snapshot,
                                            timeouts=timeouts, resume=resume)


def ref(m: dict[str, Any]) -> SnapshotRef:
    return SnapshotRef(m["snapshot_id"], MachineSpec(**m["machine"]), m["created_at"],
                       m.get("parent_id"), m)


def fake_node(root: Path, repository: str, driver: FakeDriver, *,
              memory_cache_mib: int = 10240) -> NodeParts:
    cfg = RuntimeConfig(state_dir=root / "state", run_dir=root / "run", repository=repository,
                        network="user", memory_cache_mib=memory_cache_mib)
    cfg.memory_dir.mkdir(parents=True, exist_ok=True)
    block: Any = FakeBlock()
    machines = Machines(cfg, block)
    machines.driver = driver  # what open() would pick; mode stays "user"
    manifests = ManifestStore(cfg.repository_spec)
    memory = MemoryFiles(cfg.memory_dir, manifests.repo, bound_mib=memory_cache_mib)
    return NodeParts(config=cfg, block=block, machines=machines, memory=memory,
                     manifests=manifests, compactor=Compactor(block, 0),  # no block server
                     forks=ForkImages(memory, min_mib=cfg.fork_share_min_mib))



async def publish_template(root: Path, repository: str, snapshot_id: str, *, mib: int,
                           memory_mb: int = 256,
                           vmm: dict[str, Any] | None = None) -> dict[str, Any]:
    """A template snapshot with `mib` MiB of random base memory, committed to the
    repository from a node of its own (`root`/`snapshot_id`-node); returns its manifest.
    `vmm` is recorded as the VMM identity that took it (None: an older snapshot)."""
    memory = MemoryFiles(root / f"{snapshot_id}-node" / "memory",
                         ManifestStore(repository).repo, bound_mib=10240)
    base_dir = memory.dir / snapshot_id / "base"
    base_dir.mkdir(parents=True)
    ram = root / f"{snapshot_id}.ram"
    ram.write_bytes(os.urandom(mib << 20))
    template = base_dir / "base.dev"
    template.write_bytes(b"device state of " + snapshot_id.encode())
    base = install_base(base_dir, ram, template, t0=time.perf_counter())
    await memory.upload(base_dir)
    # the sha256 a fetch checks (computed here, not taken from upload(): the same either way)
    files = {memory.rel(f): hash_file(f).hex() for f in sorted(base_dir.iterdir())}
    m: dict[str, Any] = {
        "version": VERSION, "kind": "template", "snapshot_id": snapshot_id,
        "created_at": time.time(), "parent_id": None,
        "machine": {"cpu_count": 1, "memory_mb": memory_mb, "disk_mb": 2048,
                    "image": "default"},
        "network_mode": "user", "image": "default", "kernel": KERNEL,
        "cmdline": "console=ttyS0",
        "config_sha256": f"fake-1-{memory_mb}-{KERNEL}",  # = FakeDriver.config_digest
        "memory": {"base_dir": memory.rel(base.dir), "base_id": base.id,
                   "devstate": memory.rel(base.template_path), "snapshot_dir": None,
                   "files": list(files), "sha256": files},
        "disk": {"layers": [LAYER], "virtual_size": 1 << 30},
        "depends_on": [snapshot_id],
    }
    if vmm is not None:
        m["vmm"] = vmm
    await ManifestStore(repository).put(snapshot_id, m)
    return m
