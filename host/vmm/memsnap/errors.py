"""Errors raised by the memory-snapshot layer.

    MemSnapError                    anything memsnap could not do (bad input, syscall or QMP failure)
    ├── CorruptSnapshotError        a diff, devstate or manifest is truncated, altered or malformed
    ├── SnapshotMismatchError       a snapshot does not belong to this base / QEMU configuration
    └── UnsupportedStreamError      a QEMU migration stream uses a feature memsnap cannot splice

The QEMU driver catches ``MemSnapError`` and translates it into its own ``VmmError``.
"""

from __future__ import annotations


class MemSnapError(Exception):
    """A memory-snapshot operation failed."""


class CorruptSnapshotError(MemSnapError):
    """A snapshot file is truncated, altered or not in the expected format."""


class SnapshotMismatchError(MemSnapError):
    """A snapshot was taken on a different base file, QEMU configuration or parent."""


class UnsupportedStreamError(MemSnapError):
    """A QEMU migration stream uses a feature (configuration section, XBZRLE, ...) not handled here."""
