"""The sandbox orchestrator: state store, lifecycle semantics, TTLs and recovery.

`NodeOrchestrator` (node.py) implements the `Orchestrator` contract (service.py) over the
SQLite `Store` (store.py) and a `SandboxRuntime` (host/contract.py); README.md maps
its modules.
"""

from host.contract import MachineSpec, Placement, SandboxRuntime, SnapshotRef

from .envd import EnvdClient
from .errors import (
                     AliasConflict,
                     AliasTaken,
                     BuildNotFound,
                     IdempotencyMismatch,
                     InvalidRequest,
                     OperationFailed,
                     OrchestratorError,
                     SandboxNotFound,
                     SnapshotNotFound,
                     StateConflict,
                     TemplateNotFound,
                     UploadTooLarge,
)
from .node import NodeOrchestrator
from .recovery import recover
from .service import Orchestrator
from .states import SandboxState
from .store import Store
from .templates.store import TemplateStore
from .ttl import TtlLoop, TtlOwner

__all__ = ["AliasConflict", "AliasTaken", "BuildNotFound", "EnvdClient",
           "IdempotencyMismatch", "InvalidRequest", "MachineSpec", "NodeOrchestrator",
           "OperationFailed", "Orchestrator", "OrchestratorError", "Placement",
           "SandboxNotFound", "SandboxRuntime", "SandboxState", "SnapshotNotFound",
           "SnapshotRef", "StateConflict", "Store", "TemplateNotFound", "TemplateStore",
           "TtlLoop", "TtlOwner", "UploadTooLarge", "recover"]
