"""Layered block storage: overlaybd LSMT layers, stacks, the NBD block server, repository, cache.

The orchestrator talks to the node's block server through `BlockServerClient` (control.py);
a VMM attaches a stack with `StackInfo.qemu_drive()` / `StackInfo.nbd_uri`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cache import ChunkCache
from .control import BlockServerClient, StackInfo, SyncBlockServerClient
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
from .lsmt import LayerWriter, SealedLayer, digest_of_file
from .repository import OssRepository, PosixFsRepository, Repository, open_repository
from .stack import Stack
from .upper import Upper

if TYPE_CHECKING:
    from .blockserver import BlockServer
    from .convert import convert_image


def __getattr__(name: str) -> Any:
    # imported lazily so `python -m host.storage.blockserver|convert` does not find its
    # own module already imported by the package (runpy warns about that)
    if name == "BlockServer":
        from .blockserver import BlockServer

        return BlockServer
    if name == "convert_image":
        from .convert import convert_image

        return convert_image
    raise AttributeError(name)


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
