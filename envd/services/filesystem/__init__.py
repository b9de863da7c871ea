"""filesystem.Filesystem: stat, list, make, move, remove and watch paths, as the requesting user."""

from __future__ import annotations

from .atomic import PendingFile, is_upload_temp
from .credentials import run_as, run_blocking, submit_blocking
from .entry import METADATA_XATTR_PREFIX, build_entry, read_metadata
from .errors import os_error_code
from .paths import InvalidPathError, resolve
from .service import FilesystemService

__all__ = [
    "METADATA_XATTR_PREFIX", "FilesystemService", "InvalidPathError", "PendingFile",
    "build_entry", "is_upload_temp", "os_error_code", "read_metadata",
    "resolve", "run_as", "run_blocking", "submit_blocking",
]
