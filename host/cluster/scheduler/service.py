"""`Scheduler`: picks the node for a sandbox and holds its place there.

    create   the best node by the strategy (placement.py) among the nodes not excluded (the
             gateway excludes nodes that refused this create), with a place reserved on it
             until the gateway binds the sandbox or the reservation expires
    fork     the parent's node: children are restored from the parent's snapshot, which
             is on that node (its own admission bounds them)
    resume   the sandbox's node while it is alive; once it is dead, any node, placed like a
             create (the gateway then asks that node to import the sandbox: phase 2)

Placements made by one process run one at a time (a lock), so concurrent creates see
each other's reservations; across scheduler replicas the reserve script re-checks the
node's sandbox limit atomically and the next node is tried when it refuses.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import NoCapacity, SandboxLost, SandboxUnknown
from ..placement import Demand, Strategy, rank, refusal_message
from ..registry import BindingState, NodeRecord, Registry

if TYPE_CHECKING:
    from .metrics import SchedulerMetrics

KINDS = ("create", "resume", "fork")


@dataclass(frozen=True)
class PlacementRequest:
    kind: str = "create"
    sandbox_id: str | None = None
    exclude: tuple[str, ...] = ()
    memory_mib: int | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.sandbox_id is not None:
            out["sandboxID"] = self.sandbox_id
        if self.exclude:
            out["exclude"] = list(self.exclude)
        if self.memory_mib is not None:
            out["memoryMiB"] = self.memory_mib
        return out


@dataclass(frozen=True)
class Placement:
    node_id: str
    address: str
    proxy_address: str
    placement_id: str | None = None     # a reservation to release or bind

    @classmethod
    def on(cls, node: NodeRecord, placement_id: str | None = None) -> Placement:
        return cls(node.node_id, node.address, node.proxy_address, placement_id)

    def wire(self) -> dict[str, Any]:
        return {"nodeID": self.node_id, "address": self.address,
                "proxyAddress": self.proxy_address, "placementID": self.placement_id}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Placement:
        return cls(str(data["nodeID"]), str(data["address"]), str(data["proxyAddress"]),
                   data.get("placementID"))


class Scheduler:
    def __init__(self, registry: Registry, *, strategy: Strategy = Strategy.LEAST_LOADED,
                 demand: Demand | None = None, placement_ttl_s: float = 60.0,
                 attempts: int = 3, metrics: SchedulerMetrics | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.strategy = strategy
        self.demand = demand or Demand()
        self.placement_ttl_ms = int(placement_ttl_s * 1000)
        self.attempts = attempts
        self._lock = asyncio.Lock()

    async def place(self, req: PlacementRequest) -> Placement:
        """The node for `req` (counted and timed in `metrics` by kind and outcome)."""
        if self.metrics is None:
            return await self._place(req)
        with self.metrics.placement(req.kind):
            return await self._place(req)

    async def _place(self, req: PlacementRequest) -> Placement:
        if req.kind == "create":
            return await self._create(req)
        if req.sandbox_id is None:
            raise SandboxUnknown(f"a {req.kind} placement needs sandboxID")
        binding = await self.registry.binding(req.sandbox_id)
        if binding is None:
            raise SandboxUnknown(f"sandbox '{req.sandbox_id}' is not bound to any node")
        node = await self.registry.node(binding.node_id)
        if node is not None and node.alive:
            return Placement.on(node)
        if req.kind == "fork" or binding.state is not BindingState.PAUSED:
            raise SandboxLost(f"sandbox '{req.sandbox_id}' was lost with node "
                              f"{binding.node_id}, which stopped heartbeating")
        return await self._create(PlacementRequest(
            kind="resume", exclude=(*req.exclude, binding.node_id), memory_mib=req.memory_mib))

    async def _create(self, req: PlacementRequest) -> Placement:
        demand = Demand(req.memory_mib) if req.memory_mib else self.demand
        async with self._lock:
            nodes: Sequence[NodeRecord] = ()
            for _ in range(self.attempts):
                nodes = await self.registry.nodes()
                turn = (await self.registry.next_turn()
                        if self.strategy is Strategy.ROUND_ROBIN else 0)
                ranked = rank([n for n in nodes if n.node_id not in req.exclude], demand,
                              self.strategy, turn)
                if not ranked:
                    break
                for node in ranked:
                    pid = secrets.token_hex(8)
                    if await self.registry.reserve(node.node_id, pid,
                                                   ttl_ms=self.placement_ttl_ms):
                        return Placement.on(node, pid)
            raise NoCapacity(refusal_message(nodes, demand, req.exclude))
