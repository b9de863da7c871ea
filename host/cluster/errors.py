"""Errors of the cluster services and the one table mapping them to E2B error bodies.

    ClusterError                  base; `status` is the HTTP status, `error_code` E2B's code
      StoreUnavailable            Redis cannot be reached or failed (503)
      SchedulerUnavailable        the gateway cannot reach the scheduler (503)
      NoCapacity                  no node can take the sandbox (429, sandbox_capacity_unavailable)
      SandboxUnknown              no node holds the sandbox (404)
      SandboxLost                 its node died while it was running (410, sandbox_lost)
      SandboxStranded             it is paused on a node that is dead (503, sandbox_node_dead)
      SandboxNotAdoptable         paused on a dead node that left no handoff (409)
      SandboxMoving               being resumed on another node by another request (409, retry)
      NodeUnknown                 GET /nodes/{id} of a node the registry does not know (404)
      NodeUnreachable             a node did not answer (502; `sent`: the request may have
                                  reached it, so it must not be replayed)

Every error leaves as `{"code": <status>, "message": ..., ["error_code": ...]}` (spec §3.1).
Statuses the SDKs retry unchanged (429, 502, 503, 504) carry `Should-Retry: false` when a
retry cannot help or could run the request twice.
"""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from host.api.errors import error_response

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5        # as the node's admission refusal (host/orchestrator/admission.py)
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})


class ClusterError(Exception):
    status = 500
    error_code: str | None = None
    retryable = False       # whether a client may send the same request again

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StoreUnavailable(ClusterError):
    status = 503
    error_code = "cluster_store_unavailable"
    retryable = True


class SchedulerUnavailable(ClusterError):
    status = 503
    error_code = "cluster_scheduler_unavailable"
    retryable = True


class NoCapacity(ClusterError):
    status = 429
    error_code = "sandbox_capacity_unavailable"
    retryable = True


class SandboxUnknown(ClusterError):
    status = 404


class SandboxLost(ClusterError):
    status = 410
    error_code = "sandbox_lost"


class SandboxStranded(ClusterError):
    """Paused on a dead node: its snapshot is in the shared repository, but no node has
    imported it (resuming it elsewhere is the connect path, see gateway/sandboxes.py)."""

    status = 503
    error_code = "sandbox_node_dead"

    def __init__(self, message: str, *, node_id: str) -> None:
        super().__init__(message)
        self.node_id = node_id


class SandboxNotAdoptable(ClusterError):
    """Paused on a dead node that left no handoff in the shared repository."""

    status = 409
    error_code = "sandbox_not_adoptable"


class SandboxMoving(ClusterError):
    """Another request is resuming this sandbox on another node right now."""

    status = 409
    error_code = "sandbox_moving"
    retryable = True


class NodeUnknown(ClusterError):
    status = 404


class NodeUnreachable(ClusterError):
    status = 502
    error_code = "cluster_node_unreachable"

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


def error_reply(exc: ClusterError, *, method: str = "GET") -> JSONResponse:
    """The E2B error response for `exc` (`method`: of the request that failed)."""
    response = error_response(exc.status, exc.message, exc.error_code)
    if isinstance(exc, NoCapacity):
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    retry = exc.retryable or (isinstance(exc, NodeUnreachable)
                              and (not exc.sent or method.upper() in _IDEMPOTENT))
    if exc.status >= 429 and not retry:
        response.headers["Should-Retry"] = "false"
    if exc.status >= 500:
        log.warning("%s: %s", type(exc).__name__, exc.message)
    return response
