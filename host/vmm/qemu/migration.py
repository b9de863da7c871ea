"""A QEMU VM's whole state over its migration stream: `save` into a file, `load` from one.

The QEMU driver's `save_state` and the restore side of `QemuVm._start` are these functions
over the VM's QMP client (`qmp`, for the stream's fd: memsnap.devstate.migration_uri) and
its checked QMP call (`call`: errors already VmmError). memsnap errors become VmmError here.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..errors import VmmError, VmmTimeout
from ..memsnap import MemSnapError
from ..memsnap.devstate import migration_uri

MIGRATE_S = 120.0
_MAX_BANDWIDTH = 100 * 1024**3  # bytes/s; the 7.2 default (32 MiB/s) makes snapshots slow

QmpCall = Callable[..., Awaitable[Any]]


async def set_ignore_shared(call: QmpCall, ram_in_file: bool) -> None:
    # With guest RAM in a share=on file, the file *is* the memory snapshot: the stream
    # then carries device state only. On restore it is set whenever RAM comes from a
    # file, so a share=on snapshot can be restored copy-on-write (share=off) by many
    # children. (QEMU never skips share=off RAM when saving: such a stream has all RAM
    # and restores into share=off or plain RAM, not into a share=on file.)
    await call("migrate-set-capabilities",
               {"capabilities": [{"capability": "x-ignore-shared", "state": ram_in_file}]})


async def _wait_done(call: QmpCall, name: str, timeout_s: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        info = await call("query-migrate")
        if info.get("status") in ("completed", "failed", "cancelled"):
            return dict(info)
        if loop.time() > deadline:
            raise VmmTimeout(f"{name}: migration not done in {timeout_s}s: {info}")
        await asyncio.sleep(0.005)


async def save(name: str, qmp: Any, call: QmpCall, dest: Path, *, ram_in_file: bool,
               timeout_s: float = MIGRATE_S) -> None:
    """The stopped VM's state into `dest` (whole or nothing: written beside it, renamed).
    With RAM in a share=on file only the device state is written."""
    part = dest.with_name(dest.name + ".part")
    await call("migrate-set-parameters", {"max-bandwidth": _MAX_BANDWIDTH})
    await set_ignore_shared(call, ram_in_file)
    dest.unlink(missing_ok=True)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        async with migration_uri(qmp, fd, what="snapshot") as uri:
            await call("migrate", {"uri": uri})
            info = await _wait_done(call, name, timeout_s)
        if info.get("status") != "completed":
            raise VmmError(f"{name}: snapshot failed: "
                           f"{info.get('error-desc', info.get('status'))}")
        part.rename(dest)
    except MemSnapError as exc:
        raise VmmError(f"{name}: snapshot failed: {exc}") from exc
    finally:
        os.close(fd)
        part.unlink(missing_ok=True)


async def load(name: str, qmp: Any, call: QmpCall, state_file: Path, *,
               ram_in_file: bool) -> str:
    """`state_file` into a QEMU started with `-incoming defer`; its run status after
    (running, or paused/postmigrate when it was saved stopped)."""
    await set_ignore_shared(call, ram_in_file)
    fd = os.open(state_file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        async with migration_uri(qmp, fd, what="restore") as uri:
            await call("migrate-incoming", {"uri": uri})
            loop = asyncio.get_running_loop()
            deadline = loop.time() + MIGRATE_S
            while (status := str((await call("query-status"))["status"])) in (
                    "inmigrate", "prelaunch"):
                if loop.time() > deadline:
                    raise VmmTimeout(f"{name}: restore not done in {MIGRATE_S}s")
                await asyncio.sleep(0.005)
    except MemSnapError as exc:
        raise VmmError(f"{name}: restore failed: {exc}") from exc
    finally:
        os.close(fd)
    return status
