"""Errors raised by the VMM drivers.

    VmmError                      anything a driver could not do (bad spec, QEMU failed, QMP error)
    ├── VmmStartError             the VMM process did not start or exited during boot
    ├── VmmStateError             operation not valid in the VM's current state
    ├── VmmSnapshotError          a memory snapshot is corrupt, incomplete or for another VM
    └── VmmTimeout (+TimeoutError)  a deadline passed
        └── VmmBootTimeout        the guest did not become ready (envd /health) in time

Boot failures carry the tail of the guest serial log and of the VMM's stderr in the message
and as attributes, so a failing test or API call shows why the guest did not come up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .memsnap.errors import MemSnapError


class VmmError(Exception):
    """A VMM driver operation failed."""

    def __init__(self, message: str, *, serial_tail: str = "", stderr_tail: str = "") -> None:
        self.serial_tail = serial_tail
        self.stderr_tail = stderr_tail
        parts = [message]
        if stderr_tail.strip():
            parts.append(f"--- VMM stderr (tail) ---\n{stderr_tail.rstrip()}")
        if serial_tail.strip():
            parts.append(f"--- guest serial log (tail) ---\n{serial_tail.rstrip()}")
        super().__init__("\n".join(parts))
        self.message = message


class VmmStartError(VmmError):
    """The VMM process failed to start or exited before the guest was ready."""


class VmmStateError(VmmError):
    """The operation is not valid in the VM's current state (e.g. pause a killed VM)."""


class VmmSnapshotError(VmmError):
    """A memory snapshot could not be taken or restored: corrupt or missing files, or a
    snapshot of another base or VMM configuration."""


class VmmTimeout(VmmError, TimeoutError):
    """A VMM operation ran past its deadline."""


class VmmBootTimeout(VmmTimeout):
    """The guest did not answer envd /health before the boot deadline."""


@contextlib.contextmanager
def memory_snapshot_errors(what: str) -> Iterator[None]:
    """memsnap's errors and file errors of a memory snapshot as VmmSnapshotError (the
    drivers' boundary)."""
    try:
        yield
    except (MemSnapError, OSError) as exc:
        raise VmmSnapshotError(f"{what}: {exc}") from exc
