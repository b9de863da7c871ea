"""Per-request facts handlers need: who the caller runs as, and its deadline."""

from __future__ import annotations

from typing import Any

from connectrpc.request import RequestContext

from ..auth import basic_auth_user
from ..state import Defaults
from ..users import User

TIMEOUT_HEADER = "connect-timeout-ms"


def request_username(ctx: RequestContext[Any, Any], defaults: Defaults) -> str:
    """`Authorization: Basic base64(user:)` user, else the sandbox default user."""
    return basic_auth_user(ctx.request_headers.get("authorization")) or defaults.user


def request_user(ctx: RequestContext[Any, Any], defaults: Defaults) -> User:
    """The Unix user the request runs as (raises UnknownUserError / AuthError)."""
    return User.lookup(request_username(ctx, defaults))


def request_timeout_s(ctx: RequestContext[Any, Any]) -> float | None:
    """Seconds left until the request's Connect-Timeout-Ms deadline; None when absent or 0.

    connectrpc parses the header but does not enforce it; a literal 0 means "no
    deadline" here (the SDKs omit the header instead, upstream envd treats 0 as none).
    """
    raw = ctx.request_headers.get(TIMEOUT_HEADER)
    if not raw or raw.strip() == "0":
        return None
    remaining_ms = ctx.timeout_ms
    if remaining_ms is None:
        return None
    return max(0.0, remaining_ms / 1000.0)


__all__ = ["request_timeout_s", "request_user", "request_username"]
