"""Errors of the node runtime.

    NodeRuntimeError
    ├── SandboxNotFoundError        no live sandbox with that id on this node
    ├── SnapshotNotFoundError       no committed snapshot manifest with that id
    └── SandboxStartError           start/restore failed (everything was rolled back)
        ├── SnapshotCorruptError    a snapshot's files fail verification (restore refused)
        └── SnapshotIncompatibleError  (also contract.SnapshotIncompatible) its memory was
                                    saved by another VMM version / accelerator / CPU model
"""

from __future__ import annotations

from host.contract import SnapshotIncompatible


class NodeRuntimeError(Exception):
    """Base class of host.runtime errors."""


class SandboxNotFoundError(NodeRuntimeError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0]) if self.args else ""


class SnapshotNotFoundError(NodeRuntimeError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SandboxStartError(NodeRuntimeError):
    pass


class SnapshotCorruptError(SandboxStartError):
    pass


class SnapshotIncompatibleError(SandboxStartError, SnapshotIncompatible):
    """Refused before anything was started: boot the snapshot's disk instead (reboot)."""
