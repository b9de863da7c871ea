"""The log of a template build: the runtime's `BuildLog` sink, and its pages.

The runtime calls the sink on the event loop and it must not block, so `BuildLogBuffer`
keeps a running build's entries in memory (the status endpoint reads them there) and
writes them to the store in batches: every `interval_s` while the build runs, and once
more before the build's final status is recorded, so a client that sees `ready` or
`error` finds every entry in the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .store import LEVELS, LogRecord

MAX_ENTRIES = 20_000       # per build; later entries are dropped (one warning says so)
MAX_MESSAGE = 16_384       # characters per entry
# characters per build, all entries together: the build's commands print what the guest
# likes, and 20,000 entries of 16,384 characters would be 320 MiB held here and stored
MAX_CHARS = 16 * 1024 * 1024

Flush = Callable[[int, list[LogRecord]], Awaitable[Any]]


class BuildLogBuffer:
    """One build's log: call it as the runtime's sink `(level, message, step)`."""

    def __init__(self, clock: Callable[[], float], *, first_seq: int = 0) -> None:
        self.clock = clock
        self.entries: list[LogRecord] = []  # seq first_seq + i
        self.first_seq = first_seq
        self.flushed = 0                    # entries already in the store
        self.truncated = False
        self.chars = 0                      # message characters held in `entries`
        self._wake = asyncio.Event()

    def __call__(self, level: str, message: str, step: str | None = None) -> None:
        if self.truncated:
            return
        if len(self.entries) >= MAX_ENTRIES or self.chars + min(
                len(str(message)), MAX_MESSAGE) > MAX_CHARS:
            self.truncated = True
            self._add("warn", f"build log truncated at {len(self.entries)} entries "
                      f"({MAX_ENTRIES} entries or {MAX_CHARS >> 20} MiB of text at most)",
                      step)
            return
        self._add(level, message, step)

    def _add(self, level: str, message: str, step: str | None) -> None:
        level = level if level in LEVELS else "info"
        text = str(message)
        if len(text) > MAX_MESSAGE:
            text = text[:MAX_MESSAGE] + " [truncated]"
        self.chars += len(text)
        self.entries.append(LogRecord(seq=self.first_seq + len(self.entries),
                                      timestamp=self.clock(), level=level, message=text,
                                      step=None if step is None else str(step)))
        self._wake.set()

    async def flush(self, write: Flush) -> None:
        """Write the entries not yet in the store."""
        pending = self.entries[self.flushed:]
        if pending:
            await write(self.first_seq + self.flushed, pending)
            self.flushed += len(pending)

    async def flush_every(self, write: Flush, interval_s: float) -> None:
        """Flush whenever there is something new, at most every `interval_s` (until
        cancelled)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush(write)
            await asyncio.sleep(interval_s)


def page(entries: Sequence[LogRecord], *, offset: int, limit: int,
         level: str | None) -> list[LogRecord]:
    """The status endpoint's page: entries at `level` or above, from `offset` (an index
    into the filtered list), at most `limit`."""
    if level is not None:
        floor = LEVELS.index(level)
        entries = [e for e in entries if LEVELS.index(e.level) >= floor]
    return list(entries[offset:offset + limit])
