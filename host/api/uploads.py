"""Signed upload URLs for COPY archives, and the upload endpoint itself.

The SDKs PUT a COPY step's archive to the `url` that `GET /templates/{id}/files/{hash}`
returns, the way they would to a presigned S3 URL: without the API key. So the URL is
authorised by itself: `/template-files/<hash>?expires=<unix s>&signature=<hex>`, where the
signature is an HMAC-SHA256 over the method, hash and expiry with a secret that never
leaves the node (a 0600 file in the state dir, made on first use; compared in constant
time). The body is streamed to the orchestrator, which keeps it only when complete and
within the size limit.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from host.private import secret_file

from . import template_models as tm
from .errors import ApiError
from .sandboxes import orch

UPLOAD_PATH = "/template-files/{hash}"
UPLOAD_PREFIX = "/template-files/"
SECRET_FILE = "template_upload.key"
DEFAULT_MAX_UPLOAD_BYTES = 2 << 30
URL_TTL_S = 3600  # the SDKs upload right after asking; a slow upload may outlast this


class UploadSigner:
    """Makes and checks the signatures of upload URLs."""

    def __init__(self, secret: bytes, *, ttl_s: int = URL_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if len(secret) < 16:
            raise ValueError("upload secret too short")
        self._secret = secret
        self.ttl_s = ttl_s
        self.clock = clock

    @classmethod
    def load_or_create(cls, path: Path) -> UploadSigner:
        """The secret in `path` (created 0600 with 32 random bytes on first use)."""
        return cls(secret_file(path))

    def _mac(self, files_hash: str, expires: int) -> str:
        msg = f"PUT\n{files_hash}\n{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def url(self, base_url: str, files_hash: str) -> str:
        """The absolute upload URL on this server (`base_url` ends with '/')."""
        expires = int(self.clock()) + self.ttl_s
        return (f"{base_url}{UPLOAD_PREFIX.lstrip('/')}{files_hash}"
                f"?expires={expires}&signature={self._mac(files_hash, expires)}")

    def check(self, files_hash: str, expires: int, signature: str) -> None:
        """ApiError 403 unless `signature` is ours for this hash and not expired."""
        good = hmac.compare_digest(self._mac(files_hash, expires).encode(), signature.encode())
        if not good or expires < self.clock():
            raise ApiError(403, "the upload URL is invalid or has expired; ask for a new one")


@dataclass(frozen=True)
class Uploads:
    """`app.state.uploads`: the signer and the size limit of one upload."""

    signer: UploadSigner
    max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES


def uploads(request: Request) -> Uploads:
    return request.app.state.uploads  # type: ignore[no-any-return]


async def upload(request: Request, *, query: tm.UploadQuery) -> Response:
    """PUT an archive to its signed URL (S3-like: 200, empty body)."""
    files_hash = str(request.path_params["hash"])
    cfg = uploads(request)
    cfg.signer.check(files_hash, query.expires, query.signature)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cfg.max_bytes:
        raise ApiError(413, f"the upload is larger than the limit of {cfg.max_bytes} bytes")
    await orch(request).put_template_file(files_hash, request.stream(),
                                          max_bytes=cfg.max_bytes)
    return Response(status_code=200)
