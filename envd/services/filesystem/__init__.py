"""filesystem.Filesystem: stat, list, make, move, remove and watch paths."""

from __future__ import annotations

from ...spec.filesystem.filesystem_connect import Filesystem
from ...state import Defaults


class FilesystemService(Filesystem):
    def __init__(self, defaults: Defaults) -> None:
        self.defaults = defaults

    async def aclose(self) -> None:
        pass


__all__ = ["FilesystemService"]
