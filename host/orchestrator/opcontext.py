"""`Context`: what the orchestrator's operation modules share.

`NodeOrchestrator` (node.py) builds one and passes it to the functions of lifecycle.py,
pausing.py, snapshots.py, forks.py, timeouts.py, guest_access.py and of templates/
(lookup.py, builds.py, files.py, builtin.py). It holds the store (and its template tables), the runtime, the envd
client, the clock and the settings, and the node-wide state every operation needs: the
per-sandbox locks, the orchestrator's task spawner, the proxy's run events, and the
running builds' logs and per-template queues. It owns no task and closes nothing: the
orchestrator does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from host.contract import MachineSpec, NetworkConfig, SandboxRuntime, SnapshotRef
from host.keyedlocks import KeyedLocks
from host.metrics import Metrics
from host.volumes import Volumes

from .admission import HOLDS_VM, Admission
from .envd import EnvdClient
from .errors import InvalidRequest, SandboxNotFound
from .model import RunEnded, SandboxInfo
from .records import GONE
from .store import SandboxRecord, Store
from .templates.build_log import BuildLogBuffer
from .templates.store import TemplateStore

log = logging.getLogger(__name__)
T = TypeVar("T")
A = TypeVar("A")
P = ParamSpec("P")


class WarmVms(Protocol):
    """Warm VMs for creates (warm.py)."""

    def take(self, ref: SnapshotRef, network: NetworkConfig) -> str | None:
        """The sandbox id of a held VM restored from `ref`, or None."""
        ...


class KeptVms(Protocol):
    """Kept VMs of paused sandboxes (kept.py)."""

    def admits(self, memory_mb: int) -> bool:
        """Whether a pause starting now may keep its VM."""
        ...

    def kept(self, sandbox_id: str) -> None:
        """The pause of `sandbox_id` committed and kept its VM."""
        ...

    def take(self, sandbox_id: str) -> bool:
        """Forget `sandbox_id`'s kept VM (its lock held); whether there was one."""
        ...


class Spawn(Protocol):
    """Runs `coro` as a task owned by the orchestrator (awaited or cancelled by its
    `aclose`); raises OperationFailed, and closes `coro`, once it is shutting down."""

    def __call__(self, coro: Coroutine[Any, Any, T], /) -> asyncio.Task[T]: ...


@dataclasses.dataclass(eq=False, kw_only=True)
class Context:
    store: Store
    runtime: SandboxRuntime
    envd: EnvdClient
    spawn: Spawn
    clock: Callable[[], float]
    machine: MachineSpec
    default_template: str
    template_aliases: frozenset[str]  # template ids that mean the default template
    default_timeout_s: int
    max_timeout_s: int
    templates: TemplateStore
    files_dir: Path                   # uploaded COPY archives, one file per filesHash
    admission: Admission = dataclasses.field(default_factory=Admission)
    warm: WarmVms | None = None       # node.py's warm pool (warm.py), if it keeps one
    kept: KeptVms | None = None       # node.py's kept VMs of paused sandboxes (kept.py)
    handoff: bool = False             # in a cluster: pauses leave a handoff (handoff.py)
    volumes: Volumes | None = None    # node.py's volumes (host/volumes; mounts.py)
    metrics: Metrics = dataclasses.field(default_factory=Metrics)  # the service's (node.py)
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    # One event per running incarnation that the proxy was routed to (made by
    # guest.route), set and dropped when that incarnation ends: see end_run.
    runs: dict[str, RunEnded] = dataclasses.field(default_factory=dict)
    # when the proxy last routed a request to each sandbox (its coldness, pressure.py)
    activity: dict[str, float] = dataclasses.field(default_factory=dict)
    # lifecycle.py's: one lock per template built on first use, in-flight idempotent creates
    template_locks: KeyedLocks = dataclasses.field(default_factory=KeyedLocks)
    idempotent: dict[str, asyncio.Task[SandboxInfo]] = dataclasses.field(default_factory=dict)
    # builds.py's: the log of each running build (by build id), one queue per template
    build_logs: dict[str, BuildLogBuffer] = dataclasses.field(default_factory=dict)
    build_queues: KeyedLocks = dataclasses.field(default_factory=KeyedLocks)

    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an operation as an owned task; the caller's cancellation does not stop it."""
        return await asyncio.shield(self.spawn(coro))

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        """The lock that serializes the operations on `sandbox_id`."""
        lock = self.locks.get(sandbox_id)
        if lock is None:
            lock = self.locks[sandbox_id] = asyncio.Lock()
        return lock

    def drop_lock(self, sandbox_id: str) -> None:
        """Forget the lock of a sandbox that is gone."""
        self.locks.pop(sandbox_id, None)

    async def db(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run a store call on the store's thread."""
        return await self.store.run(fn, *args, **kwargs)  # type: ignore[no-any-return,no-untyped-call]

    async def record(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox's record; SandboxNotFound when unknown or killed."""
        rec = await self.db(self.store.get_sandbox, sandbox_id)
        if rec.state in GONE:
            raise SandboxNotFound(sandbox_id)
        return rec

    async def vm_holders(self) -> int:
        """How many sandboxes hold (or are getting) a VM on this node."""
        return len(await self.db(self.store.list_sandboxes, HOLDS_VM))

    def check_timeout(self, timeout_s: int, what: str = "timeout") -> None:
        if timeout_s < 0 or timeout_s > self.max_timeout_s:
            raise InvalidRequest(f"'{what}' must be between 0 and {self.max_timeout_s} seconds, "
                                 f"got {timeout_s}")

    async def release(self, sandbox_id: str) -> None:
        """runtime.kill, logged instead of raised (used on paths already failing)."""
        try:
            await self.runtime.kill(sandbox_id)
        except Exception:
            log.exception("releasing sandbox %s failed", sandbox_id)

    def end_run(self, sandbox_id: str, reason: str) -> None:
        """The running incarnation of `sandbox_id` ends (`reason`: "paused", "killed", ...):
        tell the proxy, whose open exchanges into it would otherwise hang on a VM that is
        gone. Called right after the store left `running`, before the VM is stopped: a
        route() that read `running` before that has its event by then (the store runs its
        calls in order on one thread), and one that reads after it cannot route here, so
        the next incarnation (a resume) gets a fresh event."""
        run = self.runs.pop(sandbox_id, None)
        if run is not None:
            run.end(reason)
        if self.volumes is not None and sandbox_id in self.volumes.serving():
            self.spawn(self.volumes.detach(sandbox_id))   # its guest's volume server
        # its coldness ends with it (a resume's first request sets it again); else one
        # entry per sandbox ever proxied stayed for the service's life
        self.activity.pop(sandbox_id, None)


def observed(operation: str) -> Callable[
        [Callable[Concatenate[Context, A, P], Coroutine[Any, Any, T]]],
        Callable[Concatenate[Context, A, P], Coroutine[Any, Any, T]]]:
    """Time the decorated operation `(ctx, sandbox id or record, ...)` in `ctx.metrics`
    (duration when it succeeds, error class when it fails) with its log records tagged
    with the sandbox id. Nested scopes of one operation count once (the outermost)."""
    def wrap(fn: Callable[Concatenate[Context, A, P], Coroutine[Any, Any, T]]
             ) -> Callable[Concatenate[Context, A, P], Coroutine[Any, Any, T]]:
        @functools.wraps(fn)
        async def run(ctx: Context, target: A, /, *args: P.args, **kwargs: P.kwargs) -> T:
            sandbox_id = target if isinstance(target, str) else getattr(target, "id", None)
            with ctx.metrics.operation(operation, sandbox_id):
                return await fn(ctx, target, *args, **kwargs)
        return run
    return wrap
