"""Which sandbox a signed envd file URL is for, when nothing else says (spec §2.4).

In E2B_SANDBOX_URL mode the SDKs' `upload_url` / `download_url` point at the proxy itself,
`/files?path=P[&username=U]&signature=v1_S[&signature_expiration=E]`: the host names no
sandbox, and a client holding only the URL (curl, a browser) sends no E2b-Sandbox-Id. The
signature is base64(sha256("P:<read|write>:U:<envd access token>[:E]")), so only the
sandbox whose token reproduces it can be meant: the proxy recomputes it with the token of
each live sandbox (constant-time comparisons) and routes to the one that matches. This
identifies, it does not authorize: envd checks the signature and its expiry again.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.datastructures import QueryParams
from starlette.types import Scope

from host.orchestrator.model import SandboxInfo

FILES_PATH = "/files"
_OPERATIONS = {"GET": "read", "POST": "write"}


@dataclass(frozen=True)
class SignedFileRequest:
    """The signed parts of a /files request, read as envd reads them."""

    path: str
    operation: str
    user: str
    signature: str
    expiration: int | None

    @classmethod
    def of(cls, scope: Scope) -> SignedFileRequest | None:
        """The request's signed parts; None unless it is a signed GET or POST /files."""
        operation = _OPERATIONS.get(scope.get("method", ""))
        if scope["type"] != "http" or scope["path"] != FILES_PATH or operation is None:
            return None
        q = QueryParams(scope.get("query_string", b""))
        signature = q.get("signature")
        if not signature:
            return None
        expiration = None
        if q.get("signature_expiration"):
            try:
                expiration = int(q["signature_expiration"])
            except ValueError:
                return None
        return cls(path=q.get("path", ""), operation=operation, user=q.get("username", ""),
                   signature=signature, expiration=expiration)

    def signed_with(self, token: str) -> bool:
        raw = f"{self.path}:{self.operation}:{self.user}:{token}"
        if self.expiration is not None:
            raw += f":{self.expiration}"
        expected = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode()
        return hmac.compare_digest(self.signature.encode(), expected.rstrip("=").encode())

    def signer(self, sandboxes: Iterable[SandboxInfo]) -> str | None:
        """The id of the sandbox whose envd access token made the signature, if any."""
        for info in sandboxes:
            if info.envd_access_token and self.signed_with(info.envd_access_token):
                return info.sandbox_id
        return None
