"""GET /nodes and GET /nodes/{nodeID}: the registry as JSON (behind the API key).

    {"nodeID", "address", "proxyAddress", "state": "ready" | "draining" | "dead",
     "capacity": {"cpuCount", "memoryMiB", "maxSandboxes"},
     "used": {"memoryMiB", "sandboxes", "load"},
     "availableMemoryMiB", "lastHeartbeat": RFC 3339, "sandboxes": <bound to it>}

`used.sandboxes` counts sandboxes holding a VM (what the node's limit bounds),
`sandboxes` every sandbox bound to the node (paused and lost ones too). A dead node also
has "deadSince". GET /nodes/{id} adds "sandboxStates" ({state: count}) and
"lostSandboxes" (ids of those that were running when it died).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import NodeUnknown
from ..registry import BindingState, NodeRecord
from .resolve import rfc3339
from .shared import ctx_of


def node_json(n: NodeRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "nodeID": n.node_id, "address": n.address, "proxyAddress": n.proxy_address,
        "state": n.state.value,
        "capacity": {"cpuCount": n.cpu_count, "memoryMiB": n.memory_mib,
                     "maxSandboxes": n.max_sandboxes},
        "used": {"memoryMiB": n.used_memory_mib, "sandboxes": n.used_sandboxes,
                 "load": n.load},
        "availableMemoryMiB": n.available_mib,
        "lastHeartbeat": rfc3339(n.last_heartbeat), "sandboxes": n.sandboxes,
    }
    if n.dead_at:
        out["deadSince"] = rfc3339(n.dead_at)
    return out


async def list_nodes(request: Request) -> Response:
    return JSONResponse([node_json(n) for n in await ctx_of(request).registry.nodes()])


async def get_node(request: Request) -> Response:
    registry = ctx_of(request).registry
    node_id = str(request.path_params["nodeID"])
    node = await registry.node(node_id)
    if node is None:
        raise NodeUnknown(f"node '{node_id}' is not in the cluster (see GET /nodes)")
    bindings = await registry.node_sandboxes(node_id)
    states: dict[str, int] = {}
    for b in bindings.values():
        states[b.state.value] = states.get(b.state.value, 0) + 1
    out = node_json(node)
    out["sandboxStates"] = states
    lost = sorted(sid for sid, b in bindings.items() if b.state is BindingState.LOST)
    if not node.alive:  # not yet swept: its running sandboxes are lost all the same
        lost = sorted(sid for sid, b in bindings.items() if b.state is not BindingState.PAUSED)
    out["lostSandboxes"] = lost
    return JSONResponse(out)
