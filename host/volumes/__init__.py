"""Volumes: E2B's persistent volumes (records, files, tokens). See README.md."""

from .errors import (
    InvalidVolume,
    PathExists,
    PathNotFound,
    Unauthorized,
    VolumeError,
    VolumeFull,
    VolumeNameTaken,
    VolumeNotFound,
)
from .files import Entry, Upload, VolumeFiles
from .service import VolumeRecord, Volumes
from .tokens import VolumeTokens

__all__ = ["Entry", "InvalidVolume", "PathExists", "PathNotFound", "Unauthorized", "Upload",
           "VolumeError", "VolumeFiles", "VolumeFull", "VolumeNameTaken", "VolumeNotFound",
           "VolumeRecord", "VolumeTokens", "Volumes"]
