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
from .records import VolumeRecord, VolumeRecords
from .service import Volumes
from .tokens import VolumeTokens

__all__ = ["Entry", "InvalidVolume", "PathExists", "PathNotFound", "Unauthorized", "Upload",
           "VolumeError", "VolumeFiles", "VolumeFull", "VolumeNameTaken", "VolumeNotFound",
           "VolumeRecord", "VolumeRecords", "VolumeTokens", "Volumes"]
