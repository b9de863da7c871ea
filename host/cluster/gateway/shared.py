"""`GatewayContext`: what the gateway's handlers share (built in the app's lifespan)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..errors import ClusterError
from ..registry import Registry
from ..store import ClusterStore
from .forward import NodeAnswer, NodeClient
from .metrics import GatewayMetrics
from .resolve import Resolver
from .scheduling import SchedulerClient

log = logging.getLogger(__name__)


@dataclass
class GatewayContext:
    store: ClusterStore
    registry: Registry
    nodes: NodeClient
    resolver: Resolver
    scheduler: SchedulerClient
    domain: str | None = None     # rewritten into Sandbox answers when set
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)

    def answer(self, answer: NodeAnswer, *, sandboxes: bool = False) -> Response:
        """A node's answer for the client; `sandboxes`: it carries Sandbox objects (one,
        or fork results) whose `domain` becomes the gateway's."""
        if not (sandboxes and self.domain and answer.status < 300 and answer.body):
            return answer.response()
        try:
            data = answer.json()
        except ValueError:
            return answer.response()
        for obj in _sandbox_objects(data):
            if "domain" in obj:
                obj["domain"] = self.domain
        return answer.response(json.dumps(data).encode())

    async def quietly(self, what: str, change: Awaitable[Any]) -> None:
        """Index bookkeeping after a node answered: a failure is logged, not the client's
        problem (the node's next heartbeat repairs the index)."""
        try:
            await change
        except ClusterError as exc:
            log.warning("cluster index: %s failed: %s", what, exc)


def _sandbox_objects(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, dict):
        return [data]
    if isinstance(data, list):   # fork: [{"sandbox": {...}} | {"error": {...}}]
        return [d["sandbox"] for d in data if isinstance(d, dict)
                and isinstance(d.get("sandbox"), dict)]
    return []


def ctx_of(request: Request) -> GatewayContext:
    return request.app.state.gateway  # type: ignore[no-any-return]
