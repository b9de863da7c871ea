"""Volume failures, each with the HTTP status E2B answers for it (host/api/errors.py maps
them by `status`)."""

from __future__ import annotations


class VolumeError(Exception):
    status = 500


class VolumeNotFound(VolumeError, LookupError):
    status = 404

    def __init__(self, volume: str) -> None:
        super().__init__("Volume not found")
        self.volume = volume


class InvalidVolume(VolumeError, ValueError):
    """A bad name, id, path or parameter (E2B answers 400)."""

    status = 400


class VolumeNameTaken(InvalidVolume):
    def __init__(self, name: str) -> None:
        super().__init__(f"Volume with name '{name}' already exists")


class PathNotFound(VolumeError, LookupError):
    status = 404

    def __init__(self, path: str) -> None:
        super().__init__(f"path '{path}' not found")


class PathExists(VolumeError):
    status = 409

    def __init__(self, path: str) -> None:
        super().__init__(f"path '{path}' already exists")


class VolumeFull(VolumeError):
    status = 507
    error_code = "insufficient_storage"


class Unauthorized(VolumeError):
    status = 401
