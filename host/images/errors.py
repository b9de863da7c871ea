"""Exceptions raised by host.images.

    ImageError
    ├── ImageReferenceError     (also ValueError) the reference is not a valid image name
    ├── ImageNotFound           (also LookupError) no such repository, tag or digest
    ├── RegistryAuthError       the registry wants credentials, or refused the ones given
    ├── RegistryUnavailable     (also ConnectionError) unreachable, TLS failure, 5xx, rate limit
    ├── UnsupportedImage        a media type, manifest schema or platform we cannot import
    └── ImageCorrupt            a blob does not match its digest or size, or is malformed

Every message names the reference (as the user wrote it) and, where one was contacted,
the registry host.
"""

from __future__ import annotations

from pathlib import Path


class ImageError(Exception):
    """Base class of every error raised by host.images."""


class ImageReferenceError(ImageError, ValueError):
    """The reference cannot be parsed as an image name."""


class ImageNotFound(ImageError, LookupError):
    """The registry has no such repository, tag or digest."""


class RegistryAuthError(ImageError):
    """The registry requires credentials, or rejected the ones given."""


class RegistryUnavailable(ImageError, ConnectionError):
    """The registry could not be reached or answered with a server error."""


class UnsupportedImage(ImageError):
    """The image uses a media type, schema or platform that cannot be imported."""


class ImageCorrupt(ImageError):
    """A blob does not match its digest or size, or its JSON is malformed. `path` is the
    cached file at fault, when there is one (pull removes it and fetches it again)."""

    def __init__(self, message: str, *, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path
