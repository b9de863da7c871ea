"""Which node holds a sandbox: its binding in the cluster index, checked against the
node's liveness.

    bound to a live node              -> that node
    running (or lost) on a dead node  -> SandboxLost (410): it died with its node
    paused on a dead node             -> SandboxStranded (503); connect resumes it elsewhere
    not bound                         -> asked of every live node (the index may be younger
                                         than the sandbox: a FLUSHALL, or a create whose
                                         binding failed); found: bound again, else 404
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from host.ids import is_sandbox_id
from host.proxy.signed import SignedFileRequest

from ..errors import (
    ClusterError,
    NodeUnreachable,
    SandboxLost,
    SandboxStranded,
    SandboxUnknown,
)
from ..registry import Binding, BindingState, NodeRecord, Registry
from .forward import NodeClient

log = logging.getLogger(__name__)

FIND_TIMEOUT_S = 10.0


def rfc3339(ts: float | None) -> str:
    if not ts:
        return "never"
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Located:
    node: NodeRecord
    binding: Binding


class Resolver:
    def __init__(self, registry: Registry, nodes: NodeClient) -> None:
        self.registry = registry
        self.nodes = nodes

    async def locate(self, sandbox_id: str) -> Located:
        binding = await self.registry.binding(sandbox_id)
        if binding is None:
            return await self.find(sandbox_id)
        node = await self.registry.node(binding.node_id)
        if node is not None and node.alive and binding.state is not BindingState.LOST:
            return Located(node, binding)
        since = rfc3339(node.last_heartbeat if node else binding.lost_at)
        if binding.state is BindingState.PAUSED:
            raise SandboxStranded(
                f"sandbox '{sandbox_id}' is paused on node {binding.node_id}, which stopped "
                f"heartbeating (last heartbeat {since}); connect to resume it on another "
                "node", node_id=binding.node_id)
        raise SandboxLost(
            f"sandbox '{sandbox_id}' was lost: its node {binding.node_id} stopped "
            f"heartbeating (last heartbeat {since}) while the sandbox was running")

    async def signer(self, signed: SignedFileRequest) -> str | None:
        """The sandbox that signed a `/files` URL naming none (E2B_SANDBOX_URL mode's
        `download_url` / `upload_url`): every live node is asked which of its sandboxes'
        envd tokens reproduces the signature (POST /cluster/signer); None when none."""
        body = json.dumps({"path": signed.path, "operation": signed.operation,
                           "username": signed.user, "signature": signed.signature,
                           "expiration": signed.expiration}).encode()

        async def ask(node: NodeRecord) -> str | None:
            try:
                answer = await self.nodes.call(node.address, "POST", "/cluster/signer",
                                               body=body, timeout_s=FIND_TIMEOUT_S,
                                               headers=[(b"content-type", b"application/json")])
            except NodeUnreachable:
                return None
            return str(answer.json()["sandboxID"]) if answer.status == 200 else None

        live = await self.registry.live_nodes()
        found = [sid for sid in await asyncio.gather(*(ask(n) for n in live)) if sid]
        return found[0] if found else None

    async def find(self, sandbox_id: str) -> Located:
        """Ask every live node for an unbound sandbox; bind it where it is found."""
        # an id no node issues is nowhere: no question to every node (a request may
        # name any routable id, host/ids.py)
        if not is_sandbox_id(sandbox_id):
            raise SandboxUnknown(f"sandbox '{sandbox_id}' not found")
        live = await self.registry.live_nodes()

        async def ask(node: NodeRecord) -> tuple[NodeRecord, str] | None:
            try:
                answer = await self.nodes.call(node.address, "GET", f"/sandboxes/{sandbox_id}",
                                               timeout_s=FIND_TIMEOUT_S)
            except NodeUnreachable:
                return None
            if answer.status != 200:
                return None
            state = answer.json().get("state", "running")
            return node, state

        found = [r for r in await asyncio.gather(*(ask(n) for n in live)) if r is not None]
        if not found:
            raise SandboxUnknown(f"sandbox '{sandbox_id}' not found")
        node, state = found[0]
        binding = Binding(sandbox_id, node.node_id,
                          BindingState.PAUSED if state == "paused" else BindingState.RUNNING)
        try:
            await self.registry.bind(sandbox_id, node.node_id, binding.state)
        except ClusterError as exc:
            log.warning("could not bind sandbox %s to node %s: %s", sandbox_id,
                        node.node_id, exc)
        return Located(node, binding)
