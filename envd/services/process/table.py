"""The registry of live processes, by pid and tag."""

from __future__ import annotations

import asyncio

from .fanout import Subscription
from .proc import ExitStatus, Output, Proc, SpawnSpec


class ProcessNotFound(LookupError):
    """No live process matches the selector."""


class ProcessTable:
    """Owns every live `Proc`; a process leaves the table when it has been reaped."""

    def __init__(self) -> None:
        self._procs: dict[int, Proc] = {}

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._procs.values()))

    async def spawn(self, spec: SpawnSpec, *, lifetime_s: float | None = None,
                    ) -> tuple[Proc, Subscription[Output, ExitStatus]]:
        proc, sub = await Proc.spawn(spec, on_exit=self._forget)
        self._procs[proc.pid] = proc
        if lifetime_s is not None:
            proc.kill_after(lifetime_s)
        return proc, sub

    def _forget(self, proc: Proc) -> None:
        if self._procs.get(proc.pid) is proc:
            del self._procs[proc.pid]

    def by_pid(self, pid: int) -> Proc:
        proc = self._procs.get(pid)
        if proc is None:
            raise ProcessNotFound(f"process with pid {pid} not found")
        return proc

    def by_tag(self, tag: str) -> Proc:
        for proc in self._procs.values():
            if proc.tag == tag:
                return proc
        raise ProcessNotFound(f"process with tag {tag} not found")

    async def aclose(self) -> None:
        """Kill and reap every process (envd shutdown)."""
        procs = list(self._procs.values())
        if procs:
            await asyncio.gather(*(p.aclose() for p in procs), return_exceptions=True)


__all__ = ["ProcessNotFound", "ProcessTable"]
