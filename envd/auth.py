"""Access-token, signature and user checks shared by the RPC and HTTP sides.

Rules (shared/spec/e2b-compat.md §2.2-2.4):
- once /init set a token, every request but GET /health needs `X-Access-Token`;
  /files may instead carry a valid `signature` (+ optional `signature_expiration`);
- the user arrives as `Authorization: Basic base64("<user>:")` on RPCs and as the
  `username` query parameter on /files; absent means the default user.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time

from .state import Defaults


class AuthError(PermissionError):
    """The request carries no valid credentials (maps to 401 / unauthenticated)."""


def token_matches(defaults: Defaults, presented: str | None) -> bool:
    if defaults.access_token is None:
        return True
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), defaults.access_token.encode())


def require_token(defaults: Defaults, presented: str | None) -> None:
    if defaults.access_token is None:
        return
    if presented is None:
        raise AuthError("missing access token (X-Access-Token header)")
    if not token_matches(defaults, presented):
        raise AuthError("invalid access token")


def file_signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode("utf-8")).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def require_file_access(
    defaults: Defaults,
    *,
    presented_token: str | None,
    path: str,
    operation: str,
    user: str,
    signature: str | None,
    expiration: str | None,
    now: float | None = None,
) -> None:
    """Authorize a /files request: a matching token, or a valid unexpired signature."""
    if defaults.access_token is None:
        return
    if presented_token is not None:
        require_token(defaults, presented_token)
        return
    if not signature:
        raise AuthError("missing access token or signature")
    exp: int | None = None
    if expiration:
        try:
            exp = int(expiration)
        except ValueError:
            raise AuthError("invalid signature expiration") from None
    expected = file_signature(path, operation, user, defaults.access_token, exp)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        raise AuthError("invalid signature")
    if exp is not None and exp < (time.time() if now is None else now):
        raise AuthError("signature is already expired")


def basic_auth_user(authorization: str | None) -> str | None:
    """Username from `Basic base64(user:)`, or None when absent."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        raise AuthError("unsupported authorization scheme")
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise AuthError("malformed basic authorization") from None
    user, _, _ = decoded.partition(":")
    return user or None
