"""Errors of the REST API and the one table that maps every failure to an E2B error body.

    ApiError            raised by the API itself (bad JSON, bad query, unknown route...)
    OrchestratorError   raised below us; mapped by `_STATUS` (see host/orchestrator/errors.py)
    VolumeError         raised by host/volumes; each class carries its E2B `status`

Every error leaves as JSON `{"code": <status>, "message": ..., ["error_code": ...]}`; the
Python SDK's generated client pops `code` and `message` and crashes without them.
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from host.orchestrator.errors import (
    AliasConflict,
    AliasTaken,
    BuildNotFound,
    CapacityExceeded,
    GuestAnswerInvalid,
    GuestUnresponsive,
    IdempotencyMismatch,
    IncompatibleSnapshot,
    InvalidRequest,
    OperationFailed,
    OrchestratorError,
    OutOfDisk,
    SandboxNotFound,
    SnapshotNotFound,
    StateConflict,
    TemplateNotFound,
    UploadTooLarge,
)
from host.volumes.errors import VolumeError

from .models import Error

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A failure the API detects itself; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, *, error_code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


# The one table: orchestrator error class -> HTTP status. Looked up along the MRO, so a
# subclass added later maps
# like its parent unless listed here. Unknown OrchestratorError subclasses fall back to
# their own `status` class attribute.
_STATUS: dict[type[Exception], int] = {
    SandboxNotFound: 404,
    SnapshotNotFound: 404,
    StateConflict: 409,
    IdempotencyMismatch: 409,   # body carries error_code idempotency_request_mismatch
    InvalidRequest: 400,
    OperationFailed: 500,
    GuestAnswerInvalid: 502,    # envd answered past a limit (host/guestio.py): not retried
    GuestUnresponsive: 503,     # Py ServiceBusyException, JS ServiceBusyError
    TemplateNotFound: 404,
    BuildNotFound: 400,         # E2B: 400 `Build '<id>' not found`
    AliasConflict: 409,         # the alias is another template's id
    AliasTaken: 403,            # the alias is owned by someone else (the built-in template)
    UploadTooLarge: 413,
    IncompatibleSnapshot: 409,  # memory saved by another VMM / CPU: resume with a reboot
    CapacityExceeded: 429,      # error_code sandbox_capacity_unavailable, Retry-After
    OutOfDisk: 507,             # error_code insufficient_storage: free disk first
}

# Statuses a client may retry unchanged; every other 5xx carries `Should-Retry: false`
# (Py SDK >= 2.61 retries 502/503/504 and even POSTs unless told not to), and so does an
# error whose class says `retryable = False` (the same guest would answer the same).
_TRANSIENT = frozenset({429, 502, 503, 504})


def status_of(exc: Exception) -> int:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return int(getattr(exc, "status", 500))


def error_response(status: int, message: str, error_code: str | None = None, *,
                   retryable: bool = True) -> JSONResponse:
    body = (Error(code=status, message=message, error_code=error_code) if error_code
            else Error(code=status, message=message))  # no error_code member when none
    final = status >= 500 and (status not in _TRANSIENT or not retryable)
    headers = {"Should-Retry": "false"} if final else None
    return JSONResponse(body.wire(), status_code=status, headers=headers)


def response_for(exc: Exception) -> JSONResponse:
    """Map any exception escaping a handler to an E2B error response."""
    if isinstance(exc, ApiError):
        return error_response(exc.status, exc.message, exc.error_code)
    if isinstance(exc, (OrchestratorError, VolumeError)):
        status = status_of(exc)
        if status >= 500:
            log.error("orchestrator failed: %s", exc, exc_info=exc)
        response = error_response(status, str(exc), getattr(exc, "error_code", None),
                                  retryable=getattr(exc, "retryable", True))
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None:   # the capacity error: the SDKs wait this long
            response.headers["Retry-After"] = str(retry_after)
        return response
    log.exception("unhandled error in the API", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}")
