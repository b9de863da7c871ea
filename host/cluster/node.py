"""The node side of the cluster: `python -m host --cluster-redis URL` makes the node a
`ClusterMember`, which owns the Redis client and the heartbeat task (heartbeat.py) and
reports what the orchestrator holds and what the machine has left.

Capacity comes from the machine (CPUs, MemTotal, MemAvailable, the 1-minute load) and
from the node's admission policy (`--max-sandboxes`, `--memory-reserve-mib`), so the
scheduler refuses what the node's admission would refuse.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from host.orchestrator.admission import HOLDS_VM
from host.orchestrator.model import ListFilter
from host.orchestrator.service import Orchestrator

from .heartbeat import Heartbeat, NodeReport
from .peers import PeerFiles
from .registry import Registry
from .store import NODE_ID, ClusterStore

if TYPE_CHECKING:
    from host.config import Config


@dataclass(frozen=True)
class Machine:
    cpu_count: int
    memory_mib: int
    available_mib: int
    load: float


def read_machine(meminfo: Path = Path("/proc/meminfo")) -> Machine:
    """CPUs this process may use, MemTotal, MemAvailable and the 1-minute load average."""
    mem: dict[str, int] = {}
    for line in meminfo.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            mem[name] = int(rest.split()[0]) // 1024
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return Machine(cpu_count=cpus, memory_mib=mem.get("MemTotal", 0),
                   available_mib=mem.get("MemAvailable", 0), load=os.getloadavg()[0])


def orchestrator_report(orch: Orchestrator, *, max_sandboxes: int = 0, reserve_mib: int = 0,
                        machine: Callable[[], Machine] = read_machine,
                        ) -> Callable[[], Awaitable[NodeReport]]:
    """The heartbeat's report of a node: its sandboxes (running and paused, by public
    state) and its capacity."""

    async def report() -> NodeReport:
        infos = await orch.list(ListFilter())
        m = await asyncio.to_thread(machine)
        return NodeReport(cpu_count=m.cpu_count, memory_mib=m.memory_mib,
                          available_mib=m.available_mib, load=m.load,
                          max_sandboxes=max_sandboxes, reserve_mib=reserve_mib,
                          used_sandboxes=sum(1 for i in infos if i.state in HOLDS_VM),
                          sandboxes={i.sandbox_id: i.state.public for i in infos})

    return report


def default_node_id() -> str:
    """The host name, made a valid node id."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-.") or "node"
    return name[:63]


def advertised_urls(cfg: Config) -> tuple[str, str]:
    """(API URL, proxy URL) other machines reach this node at: --advertise-url, else the
    listen address (the host name when it listens on every address); the proxy's URL
    defaults to the API's host with the proxy port."""
    scheme = "https" if cfg.tls else "http"
    if cfg.advertise_url:
        api = cfg.advertise_url.rstrip("/")
    else:
        host = socket.getfqdn() if cfg.listen in ("0.0.0.0", "::") else cfg.listen
        api = f"{scheme}://{f'[{host}]' if ':' in host else host}:{cfg.api_port}"
    if cfg.advertise_proxy_url:
        return api, cfg.advertise_proxy_url.rstrip("/")
    parts = urlsplit(api)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{f'[{host}]' if ':' in host else host}:{cfg.proxy_port}"
    return api, urlunsplit((parts.scheme, netloc, "", "", ""))


class ClusterMember:
    """This node in the cluster: the store client and the heartbeat, started and closed
    together (`start()`, `await aclose()`)."""

    def __init__(self, store: ClusterStore, heartbeat: Heartbeat,
                 peers: PeerFiles | None = None) -> None:
        self.store = store
        self.heartbeat = heartbeat
        self.peers = peers   # with --p2p: memory files from and for the neighbours

    @classmethod
    def from_config(cls, cfg: Config, orch: Orchestrator,
                    node_key: str | None = None) -> ClusterMember:
        if not cfg.cluster_redis:
            raise ValueError("the node is not in a cluster (no --cluster-redis)")
        node_id = cfg.node_id or default_node_id()
        if not NODE_ID.match(node_id):
            raise ValueError(f"invalid node id {node_id!r}")
        api, proxy = advertised_urls(cfg)
        store = ClusterStore.from_url(cfg.cluster_redis)
        report = orchestrator_report(orch, max_sandboxes=cfg.max_sandboxes,
                                     reserve_mib=cfg.memory_reserve_mib)
        beat = Heartbeat(Registry(store), node_id=node_id, address=api, proxy_address=proxy,
                         report=report, interval_s=cfg.heartbeat_s,
                         misses=cfg.heartbeat_misses, disown=orch.forget,
                         joined=orch.resume_drained)
        if cfg.p2p and not node_key:
            raise ValueError("--p2p needs the node key its neighbours accept")
        peers = PeerFiles(Registry(store), node_id, node_key) if cfg.p2p and node_key else None
        return cls(store, beat, peers)

    def start(self) -> None:
        self.heartbeat.start()

    async def aclose(self) -> None:
        try:
            await self.heartbeat.aclose()
            if self.peers is not None:
                await self.peers.aclose()
        finally:
            await self.store.aclose()

