"""Layered block storage: overlaybd LSMT layers, stacks, the NBD block server, repository, cache.

The orchestrator talks to the node's block server through `BlockServerClient` (control.py);
a VMM attaches a stack with `StackInfo.qemu_drive()` / `StackInfo.nbd_uri`.
"""

from __future__ import annotations

from .blockserver import BlockServer
from .cache import ChunkCache
from .control import BlockServerClient, StackInfo, SyncBlockServerClient
from .convert import convert_image
from .errors import (
    ControlError,
    LayerFormatError,
    LayerNotFoundError,
    OutOfRangeError,
    RepositoryConfigError,
    RepositoryError,
    StackError,
    StackExistsError,
    StackNotFoundError,
    StorageError,
)
from .lsmt import LayerWriter, SealedLayer, Upper, digest_of_file
from .repository import OssRepository, PosixFsRepository, Repository, open_repository
from .stack import Stack

__all__ = [
    "BlockServer",
    "BlockServerClient",
    "ChunkCache",
    "ControlError",
    "LayerFormatError",
    "LayerNotFoundError",
    "LayerWriter",
    "OssRepository",
    "OutOfRangeError",
    "PosixFsRepository",
    "Repository",
    "RepositoryConfigError",
    "RepositoryError",
    "SealedLayer",
    "Stack",
    "StackError",
    "StackExistsError",
    "StackInfo",
    "StackNotFoundError",
    "StorageError",
    "SyncBlockServerClient",
    "Upper",
    "convert_image",
    "digest_of_file",
    "open_repository",
]
