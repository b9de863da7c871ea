"""The durable store of sealed layers and snapshot manifests: `posix_fs` or `oss` (S3).

Layers live under `layers/<hex>.lsmt`, manifests under `manifests/<name>.json`, and other
immutable files (memory snapshots) under `files/<key>`. All are made visible atomically:
posix_fs writes a temp file (or hard-links one), fsyncs and renames; oss uploads with a
multipart upload (an object appears only when the upload completes) and a manifest with one
PUT, after everything it names. So a crash never leaves half a snapshot visible.

What comes back from `oss` is checked (integrity.py): a layer is uploaded after its chunk
sums (`layers/<hex>.sums.json`), which the chunk cache checks every fetched chunk against;
`put_file` returns the sha256 of the file's content, which `fetch_file(sha256=)` checks.

Each repository counts the bytes it moves (`transferred`, read by the host's metrics):
copies and network transfers, not the hard links posix_fs makes on one filesystem.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

from ..errors import RepositoryConfigError
from .base import Repository, Transferred, digest_hex
from .oss import OssRepository
from .posix import PosixFsRepository

__all__ = ["OssRepository", "PosixFsRepository", "Repository", "Transferred", "digest_hex",
           "open_repository"]


def open_repository(spec: str) -> PosixFsRepository | OssRepository:
    """A repository from a spec string.

    `posix_fs:/path` or a plain path → PosixFsRepository;
    `oss://BUCKET/PREFIX?endpoint=URL&region=R[&addressing_style=path]` → OssRepository
    (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or boto3's usual chain).
    """
    if spec.startswith(("oss://", "s3://")):
        u = urlparse(spec)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        return OssRepository(bucket=u.netloc, prefix=u.path, endpoint=q.get("endpoint"),
                             region=q.get("region"),
                             addressing_style=q.get("addressing_style", "path"))
    spec = spec.removeprefix("posix_fs:")
    if not spec:
        raise RepositoryConfigError("posix_fs repository: a directory is required")
    return PosixFsRepository(spec)
