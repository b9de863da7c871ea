"""An in-memory `Orchestrator` test double.

Allowed ONLY for unit tests of the HTTP mapping (REST API, proxy routing): it keeps
sandboxes in a dict and runs no VM. The VM-backed orchestrator replaces it in the
end-to-end tests once it exists. Template operations go to a real `NodeOrchestrator` over
the fake runtime (tests/orchestrator/fakes.py) in a temporary directory, made on first
use: the fuzz run and the HTTP-mapping tests then reach the real template semantics.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import secrets
import shutil
import string
import tempfile
import time
from collections.abc import AsyncIterable, Sequence
from pathlib import Path
from typing import Any

from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import (
    IdempotencyMismatch,
    SandboxNotFound,
    SnapshotNotFound,
    StateConflict,
    TemplateNotFound,
)
from host.orchestrator.model import (
    BuildRequest,
    BuildStart,
    BuildStatus,
    CreateRequest,
    ForkResult,
    ListFilter,
    LogLine,
    Metric,
    NetworkConfig,
    RequestedBuild,
    Route,
    RunEnded,
    SandboxInfo,
    SnapshotInfo,
    TemplateInfo,
    TemplateTag,
)
from host.orchestrator.states import SandboxState
from host.volumes import Volumes
from tests.orchestrator.fakes import FakeEnvd, FakeRuntime

_ALNUM = string.ascii_lowercase + string.digits


def new_id() -> str:
    return "i" + "".join(secrets.choice(_ALNUM) for _ in range(20))


class FakeOrchestrator:
    """Keeps SandboxInfo values in a dict; `targets` maps (id, port) -> (host, port)."""

    def __init__(self, domain: str | None = "sbx.test") -> None:
        self.domain = domain
        self.sandboxes: dict[str, SandboxInfo] = {}
        self.snapshots: dict[str, SnapshotInfo] = {}
        self.idempotency: dict[str, tuple[CreateRequest, str]] = {}
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.unhealthy: list[str] = []                  # health()'s reasons
        self.upstream: tuple[str, int] | None = None    # route() target for every port
        self.port_map: dict[int, int] = {}               # sandbox port -> local port
        # route()'s RunEnded per sandbox, with the loop it was made on (the proxy's)
        self.runs: dict[str, tuple[RunEnded, asyncio.AbstractEventLoop]] = {}
        self._clock = 1_700_000_000.0
        self._node: NodeOrchestrator | None = None
        self._node_dir: Path | None = None

    def add(self, *, state: SandboxState = SandboxState.RUNNING, metadata: dict[str, str] | None = None,
            template: str = "base", traffic_token: str | None = None,
            token: str | None = "envd-token", started_at: float | None = None,
            network: NetworkConfig | None = None) -> SandboxInfo:
        self._clock += 1
        sid = new_id()
        start = self._clock if started_at is None else started_at
        info = SandboxInfo(
            sandbox_id=sid, template_id=template, alias=template, state=state, cpu_count=2,
            memory_mb=512, disk_mb=2048, started_at=start, end_at=start + 300,
            envd_version="0.6.13", envd_access_token=token, traffic_access_token=traffic_token,
            metadata=dict(metadata or {}), auto_pause=True, auto_resume=False,
            network=network or NetworkConfig(allow_public_traffic=traffic_token is None))
        self.sandboxes[sid] = info
        return info

    def _get(self, sandbox_id: str) -> SandboxInfo:
        info = self.sandboxes.get(sandbox_id)
        if info is None or info.state is SandboxState.KILLED:
            raise SandboxNotFound(sandbox_id)
        return info

    def _set(self, info: SandboxInfo, **changes: object) -> SandboxInfo:
        new = dataclasses.replace(info, **changes)  # type: ignore[arg-type]
        self.sandboxes[new.sandbox_id] = new
        return new

    async def create(self, req: CreateRequest) -> SandboxInfo:
        self.calls.append(("create", (req,)))
        if req.idempotency_key:
            seen = self.idempotency.get(req.idempotency_key)
            if seen is not None:
                if seen[0] != req:
                    raise IdempotencyMismatch(req.idempotency_key)
                return self._get(seen[1])
        info = self.add(metadata=req.metadata, template=req.template_id,
                        token="envd-token" if req.secure else None,
                        traffic_token=None if req.network.allow_public_traffic else "traffic")
        info = self._set(info, network=req.network, auto_pause=req.auto_pause,
                         auto_resume=req.auto_resume)
        if req.idempotency_key:
            self.idempotency[req.idempotency_key] = (req, info.sandbox_id)
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._get(sandbox_id)

    async def list(self, flt: ListFilter) -> Sequence[SandboxInfo]:
        self.calls.append(("list", (flt,)))
        states = flt.states or {SandboxState.RUNNING, SandboxState.PAUSED}
        out = []
        for info in self.sandboxes.values():
            if info.state not in states:
                continue
            if any(info.metadata.get(k) != v for k, v in flt.metadata.items()):
                continue
            if flt.template and flt.template not in (info.template_id, info.alias):
                continue
            if flt.started_after is not None and info.started_at <= flt.started_after:
                continue
            out.append(info)
        return out

    async def kill(self, sandbox_id: str) -> None:
        self._set(self._get(sandbox_id), state=SandboxState.KILLED)
        self.end_run(sandbox_id, "killed")

    def end_run(self, sandbox_id: str, reason: str) -> bool:
        """Set the sandbox's `Route.gone` (thread-safe: on the loop that routed to it)."""
        entry = self.runs.pop(sandbox_id, None)
        if entry is None:
            return False
        run, loop = entry
        loop.call_soon_threadsafe(run.end, reason)
        return True

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        self.calls.append(("set_timeout", (sandbox_id, timeout_s)))
        info = self._get(sandbox_id)
        self._set(info, end_at=time.time() + timeout_s)

    async def extend_timeout(self, sandbox_id: str, duration_s: int) -> None:
        self.calls.append(("extend_timeout", (sandbox_id, duration_s)))
        self._get(sandbox_id)

    async def pause(self, sandbox_id: str, *, memory: bool = True,
                    require_healthy: bool = False) -> None:
        self.calls.append(("pause", (sandbox_id, memory, require_healthy)))
        info = self._get(sandbox_id)
        if info.state is not SandboxState.RUNNING:
            raise StateConflict(sandbox_id, info.state, {SandboxState.RUNNING})
        self._set(info, state=SandboxState.PAUSED, pause_mode="full" if memory else "filesystem")
        self.end_run(sandbox_id, "paused")

    async def connect(self, sandbox_id: str, timeout_s: int | None, *,
                      memory: bool = True) -> tuple[SandboxInfo, bool]:
        self.calls.append(("connect", (sandbox_id, timeout_s, memory)))
        info = self._get(sandbox_id)
        if info.state is SandboxState.PAUSED:
            return self._set(info, state=SandboxState.RUNNING, pause_mode=None), True
        return info, False

    async def adopt(self, sandbox_id: str) -> SandboxInfo:
        self.calls.append(("adopt", (sandbox_id,)))
        return self._get(sandbox_id)  # the double's "repository" is its dict

    async def forget(self, sandbox_id: str) -> bool:
        self.calls.append(("forget", (sandbox_id,)))
        info = self._get(sandbox_id)
        if info.state is not SandboxState.PAUSED:
            return False
        del self.sandboxes[sandbox_id]
        return True

    def resume_drained(self) -> None:
        self.calls.append(("resume_drained", ()))

    async def snapshot(self, sandbox_id: str, name: str | None) -> SnapshotInfo:
        self._get(sandbox_id)
        self._clock += 1
        snap_id = f"team/{name}:default" if name else f"team/{new_id()}:default"
        snap = SnapshotInfo(snapshot_id=snap_id, names=(snap_id,), sandbox_id=sandbox_id,
                            created_at=self._clock)
        self.snapshots[snap_id] = snap
        return snap

    async def list_snapshots(self, sandbox_id: str | None, name: str | None) -> Sequence[SnapshotInfo]:
        return [s for s in self.snapshots.values()
                if (sandbox_id is None or s.sandbox_id == sandbox_id)
                and (name is None or name in s.snapshot_id)]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        self.calls.append(("delete_snapshot", (snapshot_id,)))
        if self.snapshots.pop(snapshot_id, None) is None:
            raise SnapshotNotFound(snapshot_id)

    async def fork(self, sandbox_id: str, count: int, timeout_s: int | None) -> Sequence[ForkResult]:
        parent = self._get(sandbox_id)
        out = [ForkResult(sandbox=self.add(metadata=parent.metadata)) for _ in range(count - 1)]
        out.append(ForkResult(error="no capacity", error_status=503))
        return out

    async def metrics(self, sandbox_id: str) -> Sequence[Metric]:
        self._get(sandbox_id)
        return [Metric(timestamp=1_700_000_000 + i, cpu_count=2, cpu_used_pct=1.5, mem_used=1,
                       mem_total=2, mem_cache=0, disk_used=3, disk_total=4) for i in range(3)]

    async def logs(self, sandbox_id: str, start_ms: int | None, limit: int) -> Sequence[LogLine]:
        self._get(sandbox_id)
        lines = [LogLine(timestamp=1_700_000_000 + i, line=f"line {i}",
                         level="error" if i == 2 else "info") for i in range(4)]
        return [ln for ln in lines if start_ms is None or ln.timestamp * 1000 >= start_ms][:limit]

    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None:
        self.calls.append(("update_network", (sandbox_id, network)))
        self._set(self._get(sandbox_id), network=network)

    async def route(self, sandbox_id: str, port: int, *, resume: bool) -> Route:
        self.calls.append(("route", (sandbox_id, port, resume)))
        info = self._get(sandbox_id)
        if info.state is SandboxState.PAUSED:
            raise StateConflict(sandbox_id, info.state, {SandboxState.RUNNING})
        if self.upstream is None:
            raise SandboxNotFound(sandbox_id)
        host, envd_port = self.upstream
        target = envd_port if port == 49983 else self.port_map.get(port, port)
        entry = self.runs.get(sandbox_id)
        if entry is None:
            entry = self.runs[sandbox_id] = (RunEnded(), asyncio.get_running_loop())
        return Route(host=host, port=target, traffic_token=info.traffic_access_token,
                     mask_request_host=info.network.mask_request_host, gone=entry[0])

    # ---- templates: a real NodeOrchestrator over the fake runtime ------------------------

    @property
    def node(self) -> NodeOrchestrator:
        if self._node is None:
            self._node_dir = Path(tempfile.mkdtemp(prefix="aenv-api-double-"))
            self.runtime = FakeRuntime()
            self.runtime.envd = FakeEnvd()
            self._node = NodeOrchestrator(
                Store(self._node_dir / "state.db"), self.runtime, domain=self.domain,
                envd=EnvdClient(transport=self.runtime.envd.transport()))
        return self._node

    @property
    def volumes(self) -> Volumes:
        return self.node.volumes

    def close(self) -> None:
        """Close the node's store and remove its directory (its tasks, fake builds that
        end in milliseconds, belong to whichever loop served the request)."""
        if self._node is not None:
            self._node.store.close()
            self._node = None
        if self._node_dir is not None:
            shutil.rmtree(self._node_dir, ignore_errors=True)
            self._node_dir = None

    async def request_build(self, req: BuildRequest) -> RequestedBuild:
        return await self.node.request_build(req)

    async def start_build(self, template_id: str, build_id: str, start: BuildStart) -> None:
        await self.node.start_build(template_id, build_id, start)

    async def build_status(self, template_id: str, build_id: str, *, offset: int = 0,
                           limit: int = 100, level: str | None = None) -> BuildStatus:
        return await self.node.build_status(template_id, build_id, offset=offset,
                                            limit=limit, level=level)

    async def collect(self, *, dry_run: bool = False) -> dict[str, Any]:
        self.calls.append(("collect", (dry_run,)))
        return {"records": {"sandboxes": 0}, "storage": {}, "dry_run": dry_run,
                "seconds": 0.0}

    def health(self) -> list[str]:
        return list(self.unhealthy)

    async def list_templates(self) -> Sequence[TemplateInfo]:
        return await self.node.list_templates()

    async def get_template(self, template_id: str) -> TemplateInfo:
        return await self.node.get_template(template_id)

    async def delete_template(self, template_id: str) -> None:
        """A template of the node, else a snapshot of this double."""
        self.calls.append(("delete_template", (template_id,)))
        try:
            await self.node.delete_template(template_id)
        except (SnapshotNotFound, TemplateNotFound):
            await self.delete_snapshot(template_id)

    async def template_alias(self, alias: str) -> tuple[str, bool]:
        return await self.node.template_alias(alias)

    async def assign_tags(self, target: str,
                          tags: Sequence[str]) -> tuple[str, builtins.list[str]]:
        return await self.node.assign_tags(target, tags)

    async def remove_tags(self, name: str, tags: Sequence[str]) -> None:
        await self.node.remove_tags(name, tags)

    async def list_tags(self, template_id: str) -> Sequence[TemplateTag]:
        return await self.node.list_tags(template_id)

    async def template_file(self, template_id: str, files_hash: str) -> bool:
        return await self.node.template_file(template_id, files_hash)

    async def put_template_file(self, files_hash: str, chunks: AsyncIterable[bytes], *,
                                max_bytes: int) -> int:
        return await self.node.put_template_file(files_hash, chunks, max_bytes=max_bytes)
