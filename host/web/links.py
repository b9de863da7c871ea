"""Short-lived signed links to a sandbox's web terminal.

A link is `/terminal/<sandbox id>?token=<expires>.<signature>`: the signature is an
HMAC-SHA256 over the sandbox id and the expiry (unix seconds) with a secret that never
leaves the node (a 0600 file in the state dir, made on first use). The token opens that one
sandbox's terminal until it expires; the page keeps it in an HttpOnly cookie scoped to the
page's path, so the WebSocket (and its reconnects) carry it without script access.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from pathlib import Path

from host.private import secret_file

SECRET_FILE = "terminal_link.key"
DEFAULT_TTL_S = 900
MAX_TTL_S = 24 * 3600


class TerminalLinks:
    """Makes and checks terminal tokens (compared in constant time)."""

    def __init__(self, secret: bytes, *, clock: Callable[[], float] = time.time) -> None:
        if len(secret) < 16:
            raise ValueError("terminal link secret too short")
        self._secret = secret
        self.clock = clock

    @classmethod
    def load_or_create(cls, state_dir: Path) -> TerminalLinks:
        return cls(secret_file(Path(state_dir) / SECRET_FILE))

    def _mac(self, sandbox_id: str, expires: int) -> str:
        msg = f"terminal\n{sandbox_id}\n{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def token(self, sandbox_id: str, ttl_s: int = DEFAULT_TTL_S) -> tuple[str, int]:
        """(token, expiry in unix seconds) opening `sandbox_id`'s terminal for `ttl_s`."""
        expires = int(self.clock()) + max(1, min(ttl_s, MAX_TTL_S))
        return f"{expires}.{self._mac(sandbox_id, expires)}", expires

    def expiry(self, sandbox_id: str, token: str | None) -> int | None:
        """The expiry of a valid, unexpired token for `sandbox_id`; None otherwise."""
        if not token:
            return None
        raw_expires, _, signature = token.partition(".")
        try:
            expires = int(raw_expires)
        except ValueError:
            return None
        good = hmac.compare_digest(self._mac(sandbox_id, expires).encode(),
                                   signature.encode("utf-8", "replace"))
        if not good or expires <= self.clock():
            return None
        return expires


__all__ = ["DEFAULT_TTL_S", "MAX_TTL_S", "SECRET_FILE", "TerminalLinks"]
