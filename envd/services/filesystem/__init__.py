"""filesystem.Filesystem: stat, list, make, move, remove and watch paths, as the requesting user;
the all-or-nothing upload files behind POST /files."""

from __future__ import annotations

from .atomic import PendingFile, PublishError, is_upload_temp, publish_all
from .credentials import run_as, run_blocking, submit_blocking
from .entry import METADATA_XATTR_PREFIX, build_entry, read_metadata
from .errors import os_error_code
from .paths import InvalidPathError, resolve
from .service import FilesystemService

__all__ = [
    "METADATA_XATTR_PREFIX", "FilesystemService", "InvalidPathError", "PendingFile",
    "PublishError", "build_entry", "is_upload_temp", "os_error_code", "publish_all",
    "read_metadata",
    "resolve", "run_as", "run_blocking", "submit_blocking",
]
