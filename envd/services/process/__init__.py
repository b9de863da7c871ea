"""process.Process: start, attach to, feed and signal processes (with PTYs); /terminal."""

from __future__ import annotations

from .fanout import Fanout, SubscriberDropped, Subscription
from .proc import ExitStatus, Proc, ProcessStateError, SpawnSpec
from .service import ProcessService
from .table import ProcessNotFound, ProcessTable
from .terminal import terminal_route

__all__ = [
    "ExitStatus",
    "Fanout",
    "Proc",
    "ProcessNotFound",
    "ProcessService",
    "ProcessStateError",
    "ProcessTable",
    "SpawnSpec",
    "SubscriberDropped",
    "Subscription",
    "terminal_route",
]
