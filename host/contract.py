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

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class NetworkConfig:
    allow_internet_access: bool = True
    allow_public_traffic: bool = True
    allow_out: tuple[str, ...] = ()       # CIDR / IP (domains accepted, not enforced)
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


class SandboxRuntime(Protocol):
    async def build_template(self, template_id: str, machine: MachineSpec) -> SnapshotRef:
        """Cold-boot `machine.image`, wait for envd, snapshot it as a template."""
        ...

    async def start(self, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                    reboot: bool = False) -> Placement:
        """Restore `snapshot` as sandbox `sandbox_id` with a fresh writable disk layer and
        its own network; returns once envd answers /health. Raises on failure and leaves
        nothing behind. `reboot` (or a filesystem-only snapshot) cold-boots the snapshot's
        disk instead of restoring its memory: a fresh envd, no processes kept."""
        ...

    async def snapshot(self, sandbox_id: str, snapshot_id: str, *, stop: bool,
                       memory: bool = True) -> SnapshotRef:
        """Snapshot a running sandbox, complete and durable before returning. stop=True is
        pause: the VM, its network and its local runtime files are released. stop=False:
        the VM continues (fork, named snapshots). memory=False (with stop=True): the disk
        only, a filesystem-only pause (`facts["memory"]` is None)."""
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

    async def find_snapshot(self, snapshot_id: str) -> SnapshotRef | None:
        """The committed snapshot `snapshot_id`, or None when it was never completed.
        Recovery asks this after a crash mid-pause: the orchestrator picks snapshot ids
        and persists them before calling `snapshot()`, so it knows what to look for.
        (Optional: recovery treats a runtime without it as "not committed".)"""
        ...

    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None: ...

    async def delete_snapshot(self, snapshot_id: str) -> None: ...

    async def console_log(self, sandbox_id: str, limit: int = 1000) -> list[str]:
        """The tail of the guest's serial console."""
        ...

    async def aclose(self) -> None:
        """Release node resources; running VMs are left running (for adoption)."""
        ...
