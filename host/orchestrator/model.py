"""Frozen request/response values of the orchestrator's Python API.

The REST API parses HTTP into these, calls `Orchestrator` (see service.py), and
serializes what comes back; nothing below the API sees HTTP objects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from host.contract import BuildStep, NetworkConfig, RegistryAuth  # also imported by the API

from .states import SandboxState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CreateRequest:
    template_id: str = "base"
    timeout_s: int = 300
    auto_pause: bool = True            # our default: TTL expiry pauses (autoPause false kills)
    auto_pause_memory: bool = True     # False: that pause keeps the filesystem only
    auto_resume: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    secure: bool = True                # issue an envd access token
    idempotency_key: str | None = None
    volume_mounts: tuple[tuple[str, str], ...] = ()   # (volume name, guest path): mounts.py


@dataclass(frozen=True)
class SandboxInfo:
    sandbox_id: str
    template_id: str
    alias: str | None
    state: SandboxState
    cpu_count: int
    memory_mb: int
    disk_mb: int
    started_at: float                  # unix seconds
    end_at: float                      # expiry (for a paused sandbox: now + TTL left)
    envd_version: str
    envd_access_token: str | None
    traffic_access_token: str | None
    metadata: dict[str, str]
    auto_pause: bool
    auto_resume: bool
    network: NetworkConfig
    client_id: str = "aenv"
    pause_mode: str | None = None      # paused: "full" (memory + disk) or "filesystem"
    volume_mounts: tuple[tuple[str, str], ...] = ()   # (volume name, guest path)


@dataclass(frozen=True)
class ListFilter:
    states: frozenset[SandboxState] | None = None   # None = running and paused
    metadata: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    started_after: float | None = None


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    names: tuple[str, ...]
    sandbox_id: str | None
    created_at: float


@dataclass(frozen=True)
class ForkResult:
    sandbox: SandboxInfo | None = None
    error: str | None = None
    error_status: int | None = None


@dataclass(frozen=True)
class Metric:
    timestamp: float
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


@dataclass(frozen=True)
class LogLine:
    timestamp: float
    line: str
    level: str = "info"


class RunEnded(asyncio.Event):
    """Set when one running incarnation of a sandbox ends (it is being paused or killed):
    the proxy then ends the exchanges it routed there instead of letting them hang on a
    VM that is gone. `reason` completes "sandbox <id> was ...". `subscribe` runs a
    callback at that moment without a task per waiter (the proxy's per-request cost).
    Call `end` on the event loop its users run on (asyncio.Event is not thread-safe)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = "stopped"
        self._subscribers: set[Callable[[], object]] = set()

    def end(self, reason: str) -> None:
        if self.is_set():
            return
        self.reason = reason
        self.set()
        subscribers, self._subscribers = self._subscribers, set()
        for fn in subscribers:
            try:
                fn()
            except Exception:
                log.exception("a RunEnded subscriber failed")

    def subscribe(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Call `fn()` once when the run ends (at once if it has); returns the function
        that unsubscribes it."""
        if self.is_set():
            fn()
            return _nothing
        self._subscribers.add(fn)
        return lambda: self._subscribers.discard(fn)


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Route:
    """Where the proxy sends traffic for one sandbox port."""

    host: str
    port: int
    traffic_token: str | None          # required on non-envd ports when set
    # network.maskRequestHost: the Host user ports see (`${PORT}` = the port), None: as sent
    mask_request_host: str | None = None
    # Ends when the running incarnation this route points into ends (the proxy then ends
    # its exchanges with it). None: the proxy does not watch.
    gone: RunEnded | None = field(default=None, compare=False)


# ---- templates (templates.py, builds.py) -----------------------------------------------

@dataclass(frozen=True)
class BuildRequest:
    """POST /v3/templates: `name` is `[namespace/]alias[:tag]`."""

    name: str
    tags: tuple[str, ...] = ()
    cpu_count: int | None = None
    memory_mb: int | None = None
    min_free_disk_mb: int | None = None


@dataclass(frozen=True)
class RequestedBuild:
    template_id: str
    build_id: str
    public: bool
    names: tuple[str, ...]
    tags: tuple[str, ...]
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class BuildStart:
    """POST /v2/templates/{id}/builds/{buildID}: the source (exactly one of `from_image`,
    `from_template`), the steps as sent (validated by the orchestrator), start/ready."""

    from_image: str | None = None
    from_template: str | None = None
    registry: RegistryAuth | None = None
    force: bool = False
    steps: tuple[BuildStep, ...] = ()
    start_cmd: str | None = None
    ready_cmd: str | None = None


@dataclass(frozen=True)
class BuildLogLine:
    timestamp: float
    level: str                         # debug | info | warn | error
    message: str
    step: str | None = None            # "base", "1".., "finalize"


@dataclass(frozen=True)
class BuildStatus:
    template_id: str
    build_id: str
    status: str                        # waiting | building | ready | error
    entries: tuple[BuildLogLine, ...] = ()
    reason: str | None = None          # why it failed
    reason_step: str | None = None
    reason_entries: tuple[BuildLogLine, ...] = ()


@dataclass(frozen=True)
class BuildInfo:
    build_id: str
    status: str
    created_at: float
    updated_at: float
    cpu_count: int
    memory_mb: int
    disk_mb: int
    finished_at: float | None = None
    envd_version: str | None = None


@dataclass(frozen=True)
class TemplateInfo:
    template_id: str
    build: BuildInfo                   # the newest build
    public: bool
    aliases: tuple[str, ...]
    names: tuple[str, ...]
    cpu_count: int
    memory_mb: int
    disk_mb: int
    created_at: float
    updated_at: float
    spawn_count: int
    last_spawned_at: float | None
    build_count: int
    envd_version: str
    builds: tuple[BuildInfo, ...] = ()  # newest first (get_template only)


@dataclass(frozen=True)
class TemplateTag:
    tag: str
    build_id: str
    created_at: float
