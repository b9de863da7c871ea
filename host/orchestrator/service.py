"""The orchestrator's Python API (what the REST API and the proxy call).

`Orchestrator` is the contract; `host.orchestrator.node.NodeOrchestrator` (VM-backed)
implements it. Errors raised are those of errors.py.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, Sequence
from typing import Any, Protocol

from .model import (
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
    SandboxInfo,
    SnapshotInfo,
    TemplateInfo,
    TemplateTag,
)


class Orchestrator(Protocol):
    domain: str | None

    async def create(self, req: CreateRequest) -> SandboxInfo: ...
    async def get(self, sandbox_id: str) -> SandboxInfo: ...
    async def list(self, flt: ListFilter) -> Sequence[SandboxInfo]: ...
    async def kill(self, sandbox_id: str) -> None: ...
    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None: ...
    async def extend_timeout(self, sandbox_id: str, duration_s: int) -> None: ...
    async def pause(self, sandbox_id: str, *, memory: bool = True,
                    require_healthy: bool = False) -> None: ...
    async def connect(self, sandbox_id: str, timeout_s: int | None, *,
                      memory: bool = True) -> tuple[SandboxInfo, bool]:
        """Resume if paused (memory=False: by a reboot of its disk). Returns (info,
        resumed). A running sandbox's TTL only grows."""
        ...

    async def adopt(self, sandbox_id: str) -> SandboxInfo:
        """Cluster: take over the paused sandbox another node left in the shared
        repository (SandboxNotFound when none did)."""
        ...

    async def forget(self, sandbox_id: str) -> bool:
        """Cluster: drop this node's records of a paused sandbox taken over elsewhere;
        False when it is not paused here."""
        ...

    def resume_drained(self) -> None:
        """Resume, in the background, what the last stop's drain paused (a cluster node
        calls it after its first heartbeat)."""
        ...
    async def snapshot(self, sandbox_id: str, name: str | None) -> SnapshotInfo: ...
    async def list_snapshots(self, sandbox_id: str | None, name: str | None) -> Sequence[SnapshotInfo]: ...
    async def delete_snapshot(self, snapshot_id: str) -> None: ...
    async def fork(self, sandbox_id: str, count: int, timeout_s: int | None) -> Sequence[ForkResult]: ...
    async def metrics(self, sandbox_id: str) -> Sequence[Metric]: ...
    async def logs(self, sandbox_id: str, start_ms: int | None, limit: int) -> Sequence[LogLine]: ...
    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None: ...
    async def route(self, sandbox_id: str, port: int, *, resume: bool) -> Route:
        """Target for proxy traffic; resumes a paused sandbox when `resume` and autoResume."""
        ...

    # ---- templates (docs/e2b-template-api.md) -------------------------------------------
    # Template ids below are a template id, an alias or `[namespace/]alias[:tag]`.
    async def request_build(self, req: BuildRequest) -> RequestedBuild:
        """A waiting build of the template `req.name` names (created on first build).
        InvalidRequest (bad name or tags), AliasConflict (409), AliasTaken (403)."""
        ...
    async def start_build(self, template_id: str, build_id: str, start: BuildStart) -> None:
        """Validate `start` (InvalidRequest naming the bad step or source) and run the
        build in the background; InvalidRequest "build is not in waiting state" when it
        was started already."""
        ...
    async def build_status(self, template_id: str, build_id: str, *, offset: int = 0,
                           limit: int = 100, level: str | None = None) -> BuildStatus: ...
    async def collect(self, *, dry_run: bool = False) -> dict[str, Any]:
        """One run of the node's collector: {records, storage, dry_run, seconds}."""
        ...

    def health(self) -> builtins.list[str]:
        """Why the node should take no new sandboxes now; [] when healthy."""
        ...

    async def list_templates(self) -> Sequence[TemplateInfo]: ...
    async def get_template(self, template_id: str) -> TemplateInfo:
        """With its builds, newest first."""
        ...
    async def delete_template(self, template_id: str) -> None:
        """A built template (InvalidRequest while sandboxes use it), else a named
        snapshot."""
        ...
    async def template_alias(self, alias: str) -> tuple[str, bool]:
        """(template id, public) of a name."""
        ...
    async def assign_tags(self, target: str,
                          tags: Sequence[str]) -> tuple[str, builtins.list[str]]:
        """Point `tags` at the build `target` (`name:tag`) names: (build id, tags)."""
        ...
    async def remove_tags(self, name: str, tags: Sequence[str]) -> None: ...
    async def list_tags(self, template_id: str) -> Sequence[TemplateTag]: ...
    async def template_file(self, template_id: str, files_hash: str) -> bool:
        """Whether the COPY archive `files_hash` was uploaded already."""
        ...
    async def put_template_file(self, files_hash: str, chunks: AsyncIterable[bytes], *,
                                max_bytes: int) -> int:
        """Store an upload under `files_hash` (whole or not at all); UploadTooLarge."""
        ...
