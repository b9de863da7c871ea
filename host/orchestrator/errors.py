"""Errors raised by the orchestrator; the API maps them to E2B error bodies.

    OrchestratorError
    ├── SandboxNotFound          404
    ├── SnapshotNotFound         404
    ├── StateConflict            409  (e.g. pausing a paused sandbox)
    ├── IdempotencyMismatch      409  (an Idempotency-Key reused with another request)
    ├── TemplateNotFound         404  (no such template, or no build with that tag)
    ├── BuildNotFound            400  (E2B answers 400 "Build '<id>' not found")
    ├── AliasConflict            409  (a template alias that is another template's id)
    ├── AliasTaken               403  (an alias owned by someone else: the built-in template)
    ├── UploadTooLarge           413  (a COPY archive over the upload limit)
    ├── InvalidRequest           400
    ├── IncompatibleSnapshot     409  (its memory was saved by another VMM / CPU: reboot it)
    ├── CapacityExceeded         429  (the node's sandbox limit or memory: admission.py)
    │   └── OutOfDisk            507  (its state dir's disk under the floor: admission.py)
    └── OperationFailed          500  (the VMM or storage failed; state was rolled back)
        └── GuestAnswerInvalid   502  (envd answered past its call's limit, host/guestio.py,
                                       or off-protocol: retrying gets the same answer)
"""

from __future__ import annotations

from host.contract import SnapshotIncompatible

from .states import SandboxState


class OrchestratorError(Exception):
    status = 500


class SandboxNotFound(OrchestratorError, LookupError):
    status = 404

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox '{sandbox_id}' not found")
        self.sandbox_id = sandbox_id


class SnapshotNotFound(OrchestratorError, LookupError):
    status = 404

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(f"snapshot '{snapshot_id}' not found")
        self.snapshot_id = snapshot_id


class StateConflict(OrchestratorError):
    status = 409

    def __init__(self, sandbox_id: str, actual: SandboxState,
                 expected: frozenset[SandboxState] | set[SandboxState]) -> None:
        want = ", ".join(sorted(s.value for s in expected))
        super().__init__(f"sandbox '{sandbox_id}' is {actual.value}, expected one of: {want}")
        self.sandbox_id = sandbox_id
        self.actual = actual
        self.expected = frozenset(expected)


class Conflict(OrchestratorError):
    """The sandbox's state does not allow this operation, for a reason its state name
    alone does not say (the message does)."""
    status = 409


class InvalidRequest(OrchestratorError, ValueError):
    status = 400


class OperationFailed(OrchestratorError):
    status = 500


class GuestAnswerInvalid(OperationFailed):
    """The sandbox's envd answered what the host refuses to read (past the call's limit,
    or not the protocol): the operation failed as any OperationFailed does (rolled
    back), but the fault is the guest's, a bad gateway, and a retry would meet the same
    guest (`Should-Retry: false`)."""

    status = 502
    retryable = False


class CapacityExceeded(OrchestratorError):
    """The node cannot take another VM start now (its sandbox limit, or the host's
    memory): nothing was started. E2B's capacity error; the client may retry later."""

    status = 429
    error_code = "sandbox_capacity_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutOfDisk(CapacityExceeded):
    """The node's state dir has less free disk than its floor (`--min-free-disk-mib`):
    nothing was started. Not retried unchanged (507): space must be freed first (`aenv
    gc`, killing sandboxes, deleting snapshots and templates)."""

    status = 507
    error_code = "insufficient_storage"


class IncompatibleSnapshot(OrchestratorError):
    """The runtime refused to restore a snapshot's memory (another VMM version, accelerator
    or CPU model saved it); nothing changed and a reboot resume would work."""

    status = 409


def start_failed(message: str, exc: Exception) -> OrchestratorError:
    """The error for a `runtime.start` that raised `exc`: a 409 naming why when the
    snapshot's memory is incompatible with this node, else OperationFailed (500)."""
    if isinstance(exc, SnapshotIncompatible):
        return IncompatibleSnapshot(message)
    if isinstance(exc, CapacityExceeded):
        return exc
    return OperationFailed(message)


class GuestUnresponsive(OrchestratorError):
    """The sandbox's envd did not answer where the operation needs it (a filesystem-only
    or strict pause): nothing was changed, the sandbox keeps running."""

    status = 503


class IdempotencyMismatch(OrchestratorError):
    status = 409
    error_code = "idempotency_request_mismatch"

    def __init__(self, key: str) -> None:
        super().__init__(f"Idempotency-Key '{key}' was already used with a different request")
        self.key = key


class TemplateNotFound(OrchestratorError, LookupError):
    status = 404


class BuildNotFound(OrchestratorError, LookupError):
    status = 400  # E2B: `Build '<id>' not found` is a 400

    def __init__(self, build_id: str) -> None:
        super().__init__(f"Build '{build_id}' not found")
        self.build_id = build_id


class AliasConflict(OrchestratorError):
    status = 409


class AliasTaken(OrchestratorError):
    status = 403


class UploadTooLarge(OrchestratorError):
    status = 413
