"""The TTL loop: pauses (autoPause, the default) or kills sandboxes whose TTL ran out,
watches for VMs that ended by themselves (`runtime.exited()` -> `vm_exited`), and retries
kills that failed (`killing` sandboxes: their VM, network or stack is not gone yet).

Owned by the orchestrator (`NodeOrchestrator.start()` starts it, `aclose()` stops it),
which it sees only through `TtlOwner`, what the loop calls. Each expiry runs as an orchestrator-owned task under the sandbox's lock and re-checks the
deadline there, so a TTL extended in the meantime wins. Paused sandboxes have no deadline
(`end_at` is NULL; `ttl_left_s` keeps what was left), so paused time never counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from host.contract import SandboxRuntime
from host.tasks import cancel_and_wait, run_every

from .errors import OrchestratorError

log = logging.getLogger(__name__)
T = TypeVar("T")


class TtlOwner(Protocol):
    """What the TTL loop calls on its orchestrator (`NodeOrchestrator` implements it)."""

    @property
    def runtime(self) -> SandboxRuntime:
        """Its `exited()` lists the sandboxes whose VM ended by itself."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, T], /) -> asyncio.Task[T]:
        """Run `coro` as an owned task; raises OrchestratorError once shutting down."""
        ...

    async def expired(self) -> list[str]:
        """Running sandboxes whose TTL has run out."""
        ...

    async def expire(self, sandbox_id: str) -> str | None:
        """Pause or kill a sandbox whose TTL ran out (re-checked); the outcome or None."""
        ...

    async def vm_exited(self, sandbox_id: str) -> str | None:
        """Settle a sandbox whose VM exited; its new state, or None if nothing was done."""
        ...

    async def unfinished_kills(self) -> list[str]:
        """Sandboxes a failed kill left `killing` (not one in progress)."""
        ...

    async def retry_kill(self, sandbox_id: str) -> str | None:
        """Kill it again; "killed", or None when nothing was left to do."""
        ...


class TtlLoop:
    def __init__(self, orchestrator: TtlOwner, *, interval_s: float = 1.0) -> None:
        self.orchestrator = orchestrator
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._busy: set[str] = set()
        self._retry_at: dict[str, float] = {}  # failed expiries back off
        self.retry_s = 30.0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ttl-loop")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        await run_every(self.interval_s, self.tick, log=log, failed="TTL loop tick failed")

    async def tick(self) -> None:
        """Start an expiry for every running sandbox past its deadline (once each), and
        settle every sandbox whose VM exited."""
        now = time.monotonic()
        for sandbox_id in self.orchestrator.runtime.exited():
            if sandbox_id not in self._busy and not self._run_once(
                    sandbox_id, self._settle_exited(sandbox_id)):
                return
        for sandbox_id in await self.orchestrator.expired():
            if sandbox_id in self._busy or self._retry_at.get(sandbox_id, 0.0) > now:
                continue
            if not self._run_once(sandbox_id, self._expire(sandbox_id)):
                return
        for sandbox_id in await self.orchestrator.unfinished_kills():
            if sandbox_id in self._busy or self._retry_at.get(sandbox_id, 0.0) > now:
                continue
            if not self._run_once(sandbox_id, self._retry_kill(sandbox_id)):
                return

    def _run_once(self, sandbox_id: str, coro: Coroutine[Any, Any, None]) -> bool:
        """Run `coro` as an orchestrator task, marking the sandbox busy until it ends;
        False when the orchestrator is shutting down."""
        self._busy.add(sandbox_id)
        try:
            task = self.orchestrator.spawn(coro)
        except OrchestratorError:  # shutting down
            self._busy.discard(sandbox_id)
            return False
        task.add_done_callback(self._done_callback(sandbox_id))
        return True

    def _done_callback(self, sandbox_id: str) -> Callable[[asyncio.Task[None]], None]:
        def done(_: asyncio.Task[None]) -> None:
            self._busy.discard(sandbox_id)
        return done

    async def _settle_exited(self, sandbox_id: str) -> None:
        try:
            outcome = await self.orchestrator.vm_exited(sandbox_id)
        except Exception:
            log.exception("settling %s after its VM exited failed", sandbox_id)
            return
        if outcome is not None:
            log.info("sandbox %s: VM exited -> %s", sandbox_id, outcome)

    async def _retry_kill(self, sandbox_id: str) -> None:
        if await self._backing_off(sandbox_id, self.orchestrator.retry_kill, "killing"):
            log.info("sandbox %s: its kill finished on a retry", sandbox_id)

    async def _expire(self, sandbox_id: str) -> None:
        outcome = await self._backing_off(sandbox_id, self.orchestrator.expire, "TTL expiry")
        if outcome:
            log.info("sandbox %s timed out: %s", sandbox_id, outcome)

    async def _backing_off(self, sandbox_id: str,
                           call: Callable[[str], Coroutine[Any, Any, str | None]],
                           what: str) -> str | None:
        """`call(sandbox_id)`'s outcome; on an OrchestratorError, logged, None, and no
        new try for this sandbox before `retry_s` (tick skips it until then)."""
        try:
            outcome = await call(sandbox_id)
        except OrchestratorError as exc:
            log.warning("%s of %s failed (retry in %.0fs): %s", what, sandbox_id,
                        self.retry_s, exc)
            self._retry_at[sandbox_id] = time.monotonic() + self.retry_s
            return None
        self._retry_at.pop(sandbox_id, None)
        return outcome
