"""Sandbox lifecycle states and the transitions the orchestrator may make.

    creating ──► running ──► pausing ──► paused ──► resuming ──► running
                   │  ▲                                 │
                   │  └── snapshotting / forking ◄──────┘ (back to running)
                   └──► killing ──► killed
Transitional states (…ing) are never final: after a crash of the host service,
recovery moves each one to running, paused or killed (see recovery.py).
"""

from __future__ import annotations

import enum


class SandboxState(str, enum.Enum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    FORKING = "forking"
    KILLING = "killing"
    KILLED = "killed"

    @property
    def transitional(self) -> bool:
        return self in TRANSITIONAL

    @property
    def public(self) -> str:
        """The state the E2B API may show: only `running` or `paused`."""
        return "paused" if self in (SandboxState.PAUSED, SandboxState.PAUSING) else "running"


TRANSITIONAL = frozenset({
    SandboxState.CREATING, SandboxState.PAUSING, SandboxState.RESUMING,
    SandboxState.SNAPSHOTTING, SandboxState.FORKING, SandboxState.KILLING,
})

# Allowed (from -> to) moves. Anything else is a bug or a conflicting request.
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.CREATING: frozenset({SandboxState.RUNNING, SandboxState.KILLING, SandboxState.KILLED}),
    SandboxState.RUNNING: frozenset({SandboxState.PAUSING, SandboxState.SNAPSHOTTING,
                                     SandboxState.FORKING, SandboxState.KILLING}),
    SandboxState.PAUSING: frozenset({SandboxState.PAUSED, SandboxState.RUNNING, SandboxState.KILLING}),
    SandboxState.PAUSED: frozenset({SandboxState.RESUMING, SandboxState.KILLING}),
    SandboxState.RESUMING: frozenset({SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.KILLING}),
    SandboxState.SNAPSHOTTING: frozenset({SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.KILLING}),
    SandboxState.FORKING: frozenset({SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.KILLING}),
    SandboxState.KILLING: frozenset({SandboxState.KILLED}),
    SandboxState.KILLED: frozenset(),
}


def can_move(src: SandboxState, dst: SandboxState) -> bool:
    return dst in TRANSITIONS[src]
