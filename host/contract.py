"""The contract between the orchestrator and the node's sandbox runtime: the value types
both sides use (MachineSpec, NetworkConfig, SnapshotRef, Placement) and the
`SandboxRuntime` protocol. It imports nothing from either package, so the runtime never
loads the orchestrator (or its store).

The orchestrator owns state (store.py), TTLs, tokens and the E2B semantics; the runtime
owns machines: it composes the VMM driver (host/vmm), memory snapshots
(host/vmm/memsnap), the block server (host/storage) and network namespaces
(host/network) into whole-sandbox operations. Data flows one way: orchestrator →
runtime → {vmm, storage, network}. The runtime never touches the state store; what it
needs to re-attach to a live VM after a host-service restart it returns as
`Placement.facts`, which the orchestrator persists and hands back to `adopt()`.

The implementation is `host.runtime.NodeRuntime`.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class NetworkConfig:
    allow_internet_access: bool = True
    allow_public_traffic: bool = True
    allow_out: tuple[str, ...] = ()       # CIDR / IP (the API refuses domains)
    deny_out: tuple[str, ...] = ()
    mask_request_host: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # accepted, kept, not enforced


@dataclass(frozen=True)
class MachineSpec:
    cpu_count: int = 1
    memory_mb: int = 512
    disk_mb: int = 2048
    image: str = "default"            # name of a `make image` build


@dataclass(frozen=True)
class SnapshotRef:
    """A complete, durable snapshot in the repository (memory + devices + disk layers).

    Everything needed to restore it is in the repository under `snapshot_id`; `facts`
    carries what the runtime wants back (layer digests, memory chain ids, ...).
    """

    snapshot_id: str
    machine: MachineSpec
    created_at: float
    parent_id: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """A live sandbox VM on this node."""

    sandbox_id: str
    envd_host: str                    # address the host (and proxy) reaches the guest at
    envd_port: int                    # envd's port at that address
    facts: dict[str, Any] = field(default_factory=dict)  # JSON-serializable; for adopt()

    def address(self, port: int) -> tuple[str, int]:
        """(host, port) for a guest port. With namespaced networking every guest port
        is reachable at envd_host; user-mode networking forwards envd's port only."""
        forwards = self.facts.get("port_forwards")
        if forwards is not None:
            return (self.envd_host, int(forwards[str(port)]))
        return (self.envd_host, port)


# -- template builds ------------------------------------------------------------------------

STEP_TYPES = ("RUN", "COPY", "ENV", "WORKDIR", "USER")


@dataclass(frozen=True)
class BuildStep:
    """One step of a template build, as E2B's `TemplateStep` carries it (wire contract:
    docs/e2b-template-api.md §5): RUN [cmd] | [cmd, user]; COPY [src, dest, user, mode]
    with `files_hash` naming the uploaded archive; ENV [k1, v1, ...]; WORKDIR [path];
    USER [name]. `force` rebuilds this step and every later one."""

    type: str
    args: tuple[str, ...] = ()
    files_hash: str | None = None
    force: bool = False


@dataclass(frozen=True)
class RegistryAuth:
    """Credentials for pulling `BuildSpec.from_image` (E2B `fromImageRegistry` type
    "registry")."""

    username: str
    password: str


@dataclass(frozen=True)
class GuestDefaults:
    """What a template sets for its sandboxes' processes (its last USER, WORKDIR and
    ENV steps, or an image's config): sent to envd's /init."""

    user: str = "user"
    workdir: str = "/home/user"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildSpec:
    """A template build. The source is `from_image` (an OCI reference), else
    `from_snapshot` (an existing template's snapshot id), else the built-in image
    `machine.image`. The result is committed as snapshot `snapshot_id`."""

    snapshot_id: str
    machine: MachineSpec
    from_image: str | None = None
    registry: RegistryAuth | None = None
    from_snapshot: str | None = None
    steps: tuple[BuildStep, ...] = ()
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False            # no build-cache hits at all (E2B `force` / skip_cache)
    files_dir: Path | None = None  # COPY archives, one file per files_hash
    min_free_disk_mb: int = 0      # E2B `minFreeDiskMb`: the disk grows to leave this free


BuildLog = Callable[[str, str, "str | None"], None]
"""A build's log sink: (level: debug|info|warn|error, message, step: "base" | "1".. |
"finalize" | None). Called from the event loop; must not block."""

Reclaim = Callable[[], Awaitable[int]]
"""A memory snapshot's `reclaim`: asks the guest to drop its page cache; the MiB freed."""


@dataclass(frozen=True)
class Balloon:
    """A running sandbox's memory balloon: MiB it returned to the host (`size_mib`), MiB
    asked (`target_mib`), and its guest's last report (None before the first): what it
    could spare (MemAvailable) and how much of that is page cache."""

    size_mib: int
    target_mib: int
    available_mib: int | None
    caches_mib: int | None = None


class BuildFailed(Exception):
    """A template build failed; `step` is where (E2B's `reason.step`), the message says
    why (a failing step's message includes its exit code; its output went to the log)."""

    def __init__(self, message: str, *, step: str | None = None) -> None:
        super().__init__(message)
        self.step = step


class SnapshotIncompatible(Exception):
    """A snapshot's memory cannot be restored on this node: it was saved by another VMM
    version, accelerator or CPU model (the message names both). Its disk can still be
    booted: a start with `reboot=True` (E2B: `connect(on_resume="reboot")`)."""


class SandboxRuntime(Protocol):
    async def build_template(self, template_id: str, machine: MachineSpec) -> SnapshotRef:
        """Cold-boot `machine.image`, wait for envd, snapshot it as a template."""
        ...

    async def build(self, spec: BuildSpec, log: BuildLog) -> SnapshotRef:
        """Build a template: the source's layers, then each step in a build VM (a step's
        disk changes sealed as a layer cached under hash(parent, step), so unchanged
        steps are cache hits), then the start command until the ready command passes,
        then memory + disk snapshot. `facts["guest"]` holds the `GuestDefaults` fields,
        `facts["build"]` what was cached. Raises BuildFailed; leaves no VM, stack,
        network or partial snapshot behind."""
        ...

    async def start(self, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                    reboot: bool = False, hold: bool = False, fanout: int = 1) -> Placement:
        """Restore `snapshot` as sandbox `sandbox_id` with a fresh writable disk layer and
        its own network; returns once envd answers /health. Raises on failure and leaves
        nothing behind. `reboot` (or a filesystem-only snapshot) cold-boots the snapshot's
        disk instead of restoring its memory: a fresh envd, no processes kept. Raises
        `SnapshotIncompatible` (before touching anything) when the memory was saved by a
        VMM this node cannot restore it with. `hold`: once envd answered, stop the VM's
        vCPUs; a later start of the same id and snapshot continues it (a warm VM for a
        create to come: `kill` releases it if none does). `fanout`: how many starts of
        `snapshot` the caller makes at once (a fork's count): the runtime may make one
        memory image for all of them to share instead of a copy of the snapshot's memory
        diff in each."""
        ...

    async def snapshot(self, sandbox_id: str, snapshot_id: str, *, stop: bool,
                       memory: bool = True, stopped: Callable[[], None] | None = None,
                       keep: bool = False, reclaim: Reclaim | None = None) -> SnapshotRef:
        """Snapshot a running sandbox, complete and durable before returning. stop=True is
        pause: the VM and its local runtime files are released, its network and disk stack
        right after (a start or kill of the same id waits for that). stop=False:
        the VM continues (fork, named snapshots). memory=False (with stop=True): the disk
        only, a filesystem-only pause (`facts["memory"]` is None). `stopped` (stop=True):
        called once the guest is stopped for good, before the snapshot is written; a
        snapshot that fails after it leaves the guest running again. `keep` (stop=True
        with memory): the committed snapshot's VM stays, stopped, like a held start's: a
        start of the same id from this snapshot continues it, `kill` releases it.
        `reclaim` (with memory): asks the guest to free its page cache (envd's
        /aenv/reclaim) and returns the MiB it freed; called before the memory cut when
        the guest's RAM differs enough from its memory file to be worth it, and the cut
        then waits, briefly, for the guest to give that memory back, so that it stays
        out of the snapshot."""
        ...

    async def kill(self, sandbox_id: str) -> None:
        """Stop the VM and release everything it held. Idempotent."""
        ...

    def exited(self) -> list[str]:
        """Sandboxes whose VM ended by itself (a crash, an OOM kill, a guest power-off),
        not through `kill` or `snapshot`, and that no operation holds right now. Cheap:
        called every watchdog tick."""
        ...

    async def adopt(self, sandbox_id: str, facts: dict[str, Any]) -> Placement | None:
        """After a host-service restart: re-attach to a still-running VM, or return None
        (and release its leftovers) when it is gone."""
        ...

    async def reap_orphans(self, known: set[str]) -> list[str]:
        """Kill VMs and release networks/stacks of sandboxes not in `known`."""
        ...

    async def salvage(self, sandbox_id: str, facts: dict[str, Any],
                      snapshot_id: str) -> SnapshotRef | None:
        """After a restart: a sandbox whose VM is gone (`adopt` returned None) but whose
        disk survived (the block server keeps it until `reap_orphans`): its disk as a
        filesystem-only snapshot `snapshot_id` (resumed by a cold boot), then its
        leftovers released. None when there is no disk to keep."""
        ...

    async def find_snapshot(self, snapshot_id: str) -> SnapshotRef | None:
        """The committed snapshot `snapshot_id`, or None when it was never completed.
        Recovery asks this after a crash mid-pause: the orchestrator picks snapshot ids
        and persists them before calling `snapshot()`, so it knows what to look for.
        (Optional: recovery treats a runtime without it as "not committed".)"""
        ...

    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None: ...

    async def listen(self, sandbox_id: str) -> socket.socket:
        """A socket listening where the running sandbox's guest, and only it, connects to
        the host's services (its gateway address, the guest service port): volume mounts.
        Raises RuntimeError where this node cannot (user-mode networking)."""
        ...

    async def delete_snapshot(self, snapshot_id: str) -> None: ...

    # Shared documents (cluster): small JSON records kept in the repository next to the
    # snapshots, so that every node sharing the repository reads them: a paused sandbox's
    # handoff (orchestrator/handoff.py), the template catalog (orchestrator/templates/catalog.py).
    # Names: letters, digits and `-_.%:`, no `/`. (Optional: a runtime without them
    # serves a node that is not in a cluster.)
    async def put_document(self, name: str, doc: dict[str, Any]) -> None: ...

    async def get_document(self, name: str) -> dict[str, Any] | None:
        """The document, or None when there is none (or it was deleted)."""
        ...

    async def delete_document(self, name: str) -> None: ...

    async def console_log(self, sandbox_id: str, limit: int = 1000) -> list[str]:
        """The tail of the guest's serial console."""
        ...

    async def collect_storage(self, *, dry_run: bool = False) -> dict[str, Any]:
        """Remove (`dry_run`: count) the layers and memory files nothing needs; per kind
        {files, bytes, digests}, and `held`: bytes on disk by kind. (Optional: the
        collector skips a runtime without it.)"""
        ...

    async def balloon(self, sandbox_id: str) -> Balloon | None:
        """The sandbox's balloon, None when its VM has none. (Optional, with
        `set_balloon`: the pressure guard pauses without first reclaiming through
        balloons on a runtime without them.)"""
        ...

    async def set_balloon(self, sandbox_id: str, amount_mib: int) -> None:
        """Inflate (deflate) its balloon to `amount_mib`; the guest gets there at its pace,
        and takes pages back rather than OOM-kill."""
        ...

    async def aclose(self) -> None:
        """Release node resources; running VMs are left running (for adoption)."""
        ...
