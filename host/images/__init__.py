"""OCI images as template sources: pull into a content-addressed cache, read layers and
chain ids (`pull`), and apply a layer tar onto a root directory (`apply.py`, a standalone
stdlib-only script with its modules `layertar.py` and `rootdir.py`: `APPLY_SCRIPTS`;
`confined.py` runs it on the host, confined).
"""

from __future__ import annotations

from pathlib import Path

from .blobs import verify_blob
from .errors import (
    ImageCorrupt,
    ImageError,
    ImageNotFound,
    ImageReferenceError,
    RegistryAuthError,
    RegistryUnavailable,
    UnsupportedImage,
)
from .layout import Image, ImageConfig, Layer, chain_ids, open_layer, read_image
from .pull import ProgressCallback, PullProgress, pull
from .reference import Reference, parse_reference
from .registry import Credentials, RegistryConfig, Source, is_insecure, resolve_source

APPLY_SCRIPT = Path(__file__).with_name("apply.py")
"""The layer applier: `python3 apply.py [--diff-id sha256:...] LAYER.tar[.gz]|- TARGET_DIR`."""
APPLY_SCRIPTS = tuple(APPLY_SCRIPT.with_name(name)
                      for name in ("apply.py", "layertar.py", "rootdir.py"))
"""apply.py and the standalone modules it imports beside it: copied together."""

__all__ = [
    "APPLY_SCRIPT",
    "APPLY_SCRIPTS",
    "Credentials",
    "Image",
    "ImageConfig",
    "ImageCorrupt",
    "ImageError",
    "ImageNotFound",
    "ImageReferenceError",
    "Layer",
    "ProgressCallback",
    "PullProgress",
    "Reference",
    "RegistryAuthError",
    "RegistryConfig",
    "RegistryUnavailable",
    "Source",
    "UnsupportedImage",
    "chain_ids",
    "is_insecure",
    "open_layer",
    "parse_reference",
    "pull",
    "read_image",
    "resolve_source",
    "verify_blob",
]
