"""Owned background tasks: a periodic loop, and stopping a task without swallowing our
own cancellation. Shared by the TTL loop, the memory-pressure guard, the cluster's
heartbeat and its dead-node sweeper."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any


async def run_every(interval_s: float, tick: Callable[[], Awaitable[Any]], *,
                    log: logging.Logger, failed: str) -> None:
    """Call `tick()` every `interval_s` until cancelled; an exception is logged (`failed`,
    with its traceback) and the loop goes on."""
    while True:
        try:
            await tick()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(failed)
        await asyncio.sleep(interval_s)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` and wait until it has ended. Its CancelledError is not ours to pass
    on, unless the caller is being cancelled itself meanwhile."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
