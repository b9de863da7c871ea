"""API keys: generated on first start, kept in a 0600 file, checked on every request.

The file holds one key per line (blank lines and `#` comments ignored). Clients send a key
as `X-API-Key` (any case; the SDKs spell it `X-API-KEY`). Only `GET /health` is open,
`GET /metrics` (Prometheus scrapes without a key; host/metrics), and the PUT of a COPY
archive to its signed URL (uploads.py), which the signature authorises.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

DEFAULT_KEYS_PATH = Path("/var/lib/aenv/api_keys")
KEY_PREFIX = "e2b_"
OPEN_PATHS = frozenset({"/health", "/metrics"})
SIGNED_PREFIX = "/template-files/"  # PUT only: the URL's signature is checked instead


def is_open(method: str, path: str) -> bool:
    """Requests that need no API key."""
    return path in OPEN_PATHS or (method == "PUT" and path.startswith(SIGNED_PREFIX))


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(30)


class ApiKeys:
    """The set of accepted API keys (compared in constant time)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in keys if k)

    @classmethod
    def load_or_create(cls, path: Path | str = DEFAULT_KEYS_PATH) -> ApiKeys:
        """Read the key file; on first start create it (mode 0600) with one new key."""
        path = Path(path)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # O_EXCL: two services starting at once must not overwrite each other's key.
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(new_key() + "\n")
        text = path.read_text()
        keys = [ln.strip() for ln in text.splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"no API keys in {path}")
        return cls(keys)

    @property
    def first(self) -> str:
        return self._keys[0].decode()

    def accepts(self, key: str | None) -> bool:
        if not key:
            return False
        given = key.encode()
        ok = False
        for k in self._keys:  # no early exit: timing does not reveal which key matched
            ok |= hmac.compare_digest(given, k)
        return ok


class ApiKeyMiddleware:
    """Pure ASGI: rejects HTTP requests without a valid X-API-Key with a 401 E2B body."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        key = None
        for name, value in scope["headers"]:
            if name == b"x-api-key":  # ASGI servers lower-case header names
                key = value.decode("latin-1")
                break
        if not self.keys.accepts(key):
            msg = "missing X-API-Key header" if key is None else "invalid API key"
            await error_response(401, msg)(scope, receive, send)
            return
        await self.app(scope, receive, send)
