"""The node's builders on disk (builder.py makes and uses them): one dir per key,
`<state dir>/builders/<key>/{ram,state}`, made under a lock per key into a dir of its own
and renamed into place whole; the MAX_KEPT most recently used are kept."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from host.keyedlocks import KeyedLocks

MAX_KEPT = 4


@dataclasses.dataclass(frozen=True)
class Builder:
    dir: Path

    @property
    def ram(self) -> Path:
        return self.dir / "ram"

    @property
    def state(self) -> Path:
        return self.dir / "state"


class Builders:
    """The node's builders under `root` (`<state dir>/builders`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._locks = KeyedLocks()

    async def get(self, key: str, make: Callable[[Builder], Awaitable[None]]) -> Builder:
        """The builder of `key`, made now by `make` (into a dir of its own, renamed into
        place when it returned) if there is none."""
        async with self._locks.hold(key):
            b = Builder(self.root / key)
            if b.state.is_file() and b.ram.is_file():
                os.utime(b.dir)  # recently used: kept
                return b
            tmp = self.root / f".{key}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            try:
                await make(Builder(tmp))
                shutil.rmtree(b.dir, ignore_errors=True)
                tmp.rename(b.dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        await asyncio.to_thread(self._trim)
        return b

    def _trim(self) -> None:
        kept = sorted((d for d in self.root.iterdir() if not d.name.startswith(".")),
                      key=lambda d: d.stat().st_mtime, reverse=True)
        for d in kept[MAX_KEPT:]:
            if not self._locks.busy(d.name):
                shutil.rmtree(d, ignore_errors=True)

    def drop(self, key: str) -> None:
        """A builder that failed (a restore or a switch): the next build makes another."""
        shutil.rmtree(self.root / key, ignore_errors=True)

    def sweep(self) -> None:
        """Builders half made by a process that died (at the node's start)."""
        if self.root.is_dir():
            for d in self.root.glob(".*"):
                shutil.rmtree(d, ignore_errors=True)
