"""`NodeParts`: what one node's runtime is made of, handed to each operation module
(templates, starts, snapshots, adoption) so none of them imports `NodeRuntime`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from host.storage.collect import Swept, counted
from host.vmm.memsnap import MemSnapError, MemSnapshot

from .blockd import BlockServerHandle
from .builderstore import Builders
from .compaction import Compactor
from .config import RuntimeConfig
from .errors import SandboxNotFoundError, SnapshotNotFoundError
from .forkimages import ForkImages
from .machines import Machines
from .manifests import ManifestStore
from .memory import MemoryFiles
from .sandbox import RunningSandbox


def build_stack(snapshot_id: str) -> str:
    """The stack, network and VM name of the build of template snapshot `snapshot_id`
    (short: it ends up in socket paths and interface names)."""
    if len(snapshot_id) <= 20:
        return f"tpl-{snapshot_id}"
    return "tpl-" + hashlib.sha256(snapshot_id.encode()).hexdigest()[:16]


@dataclass
class Claims:
    """What this node put in a shared repository and holds no local record of: made by an
    earlier run whose state dir was lost, or collected here after its last holdings.
    Still this node's to delete (holds.py): layers (hex) and memory (snapshot ids)."""
    layers: set[str] = field(default_factory=set)
    memory: set[str] = field(default_factory=set)


@dataclass
class NodeParts:
    config: RuntimeConfig
    block: BlockServerHandle
    machines: Machines
    memory: MemoryFiles
    manifests: ManifestStore
    compactor: Compactor
    forks: ForkImages
    sandboxes: dict[str, RunningSandbox] = field(default_factory=dict)
    busy: set[str] = field(default_factory=set)      # sandbox ids being started
    building: set[str] = field(default_factory=set)  # template ids being built
    last_timings: dict[str, float] = field(default_factory=dict)
    # network + stack teardowns left running after a pause (release(wait=False))
    teardowns: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # layer digest -> starts about to stack it (collect.py keeps them)
    layer_pins: Counter[str] = field(default_factory=Counter)
    lost: Claims | None = None  # read from this node's last holdings at its first (holds.py)
    builders: Builders | None = None  # builder.py's, where the node makes them
    blank_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # imports.blank_layer

    def get(self, sandbox_id: str) -> RunningSandbox:
        try:
            return self.sandboxes[sandbox_id]
        except KeyError:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id} on this node") from None

    @contextlib.contextmanager
    def pin_layers(self, digests: Iterable[str]) -> Iterator[None]:
        """Keep `digests` out of a layer collection while the block runs (a start, from
        its manifest's read until its stack holds them); released on every way out."""
        with counted(self.layer_pins, digests):
            yield

    def pinned_memory(self) -> set[str]:
        """Memory dirs this node needs locally now: live sandboxes' bases and diff chains,
        templates being built, snapshots being written, files being fetched."""
        live: list[Path] = []
        for sb in self.sandboxes.values():
            live += [p for p in (sb.base_dir, sb.memsnap_dir) if p is not None]
            if sb.memsnap_dir is not None:
                with contextlib.suppress(MemSnapError):
                    live += list(MemSnapshot.load(sb.memsnap_dir).diffs)
        return self.memory.pinned(live) | set(self.building)

    async def committed(self, snapshot_id: str) -> bool:
        try:
            await self.manifests.get(snapshot_id)
        except SnapshotNotFoundError:
            return False
        return True

    async def release(self, sb: RunningSandbox, *, wait: bool = True) -> None:
        """Forget the sandbox and release its VM, network and stack. `wait=False` (a
        pause, whose snapshot is committed): returns once the VM is gone (its memory is
        free) and leaves the network and the stack to a task that `settle` awaits (a
        start of the same id does)."""
        self.sandboxes.pop(sb.sandbox_id, None)
        await self.machines.release_vm(sb.vm)
        if wait:
            await self._teardown(sb.sandbox_id, sb.stack)
            return
        sid = sb.sandbox_id
        task = asyncio.get_running_loop().create_task(self._teardown(sid, sb.stack),
                                                      name=f"teardown-{sid}")
        self.teardowns[sid] = task
        task.add_done_callback(
            lambda t: self.teardowns.pop(sid) if self.teardowns.get(sid) is t else None)

    async def _teardown(self, sid: str, stack: str) -> None:
        await self.machines.drop_net(sid)  # logs what it could not remove
        with contextlib.suppress(Exception):
            await self.machines.drop_stack(stack)

    async def settle(self, sandbox_id: str | None = None) -> None:
        """Until the teardowns left by `release(wait=False)` (of one sandbox, or all) end."""
        if sandbox_id is None:
            tasks = list(self.teardowns.values())
        else:
            tasks = [t for t in (self.teardowns.get(sandbox_id),) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def trim_memory(self) -> None:
        await self.memory.trim(self.pinned_memory, self.committed)

    async def gc_memory(self, *, dry_run: bool = False) -> tuple[set[str], Swept]:
        """Remove local memory dirs nothing uses; returns the snapshot ids still used and
        what went (or would go, `dry_run`)."""
        manifests = await self.manifests.all()
        used: set[str] = set(manifests) | self.pinned_memory()
        for m in manifests.values():
            used |= set(m.get("depends_on", ()))
        return used, await self.memory.gc(used, dry_run=dry_run)
