"""Volume tokens: what the SDKs send as `Authorization: Bearer` to the volume content API.

E2B mints a short-lived JWT per `POST /volumes` and `GET /volumes/{id}`; the SDKs treat it
as opaque. Ours is `v1.<volume id>.<expiry unix s>.<hex HMAC-SHA256>` over the id and
expiry, keyed by a 0600 secret in the state dir that never leaves the node, checked in
constant time. A token opens one volume only, and dies with it (the service also checks
that the volume still exists).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

from .errors import Unauthorized

TOKEN_TTL_S = 3600   # E2B's default (VOLUME_TOKEN_DURATION); the SDKs fetch a new one on connect


class VolumeTokens:
    def __init__(self, secret: bytes, *, ttl_s: int = TOKEN_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if len(secret) < 16:
            raise ValueError("volume token secret too short")
        self._secret = secret
        self.ttl_s = ttl_s
        self.clock = clock

    def _mac(self, volume_id: str, expires: int) -> str:
        msg = f"volume\n{volume_id}\n{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def mint(self, volume_id: str) -> str:
        expires = int(self.clock()) + self.ttl_s
        return f"v1.{volume_id}.{expires}.{self._mac(volume_id, expires)}"

    def check(self, token: str | None, volume_id: str) -> None:
        """Unauthorized unless `token` is ours, for `volume_id`, and not expired."""
        if not token:
            raise Unauthorized("missing volume token (Authorization: Bearer <token>)")
        parts = token.split(".")
        good = False
        if len(parts) == 4 and parts[0] == "v1" and parts[2].isdigit():
            want = self._mac(parts[1], int(parts[2]))
            good = hmac.compare_digest(want.encode(), parts[3].encode("utf-8", "replace"))
            good = good and parts[1] == volume_id and int(parts[2]) >= self.clock()
        if not good:
            raise Unauthorized("invalid or expired volume token; get a new one with "
                               "Volume.connect")
