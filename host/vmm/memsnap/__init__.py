"""Incremental memory snapshots for QEMU VMs that map a frozen base file MAP_PRIVATE.

Flow: ``freeze_base`` (share=on template VM) -> children on the base with share=off ->
``snapshot_incremental`` (private pages -> diff, device state) -> ``restore_into`` a fresh
``-incoming defer -S`` QEMU. Lower-level pieces (pagemap scan, diff format, chains, capture,
inject, device-state splicing) are exported for the driver and tests.
"""

from __future__ import annotations

from .base import BaseImage, copy_sparse_hashing, freeze_base, hash_file, verify_base
from .capture import Capture, CaptureBuffer, capture_private
from .chain import DiffChain, compact, delta_pages, write_cumulative, write_delta
from .devstate import (
    check_device_stream,
    load_device_state,
    parse_ram_prefix,
    save_device_state,
    save_template,
    splice,
)
from .diff import DiffFile, DiffHeader, DiffKind, parse_header, write_diff
from .errors import (
    CorruptSnapshotError,
    MemSnapError,
    SnapshotMismatchError,
    UnsupportedStreamError,
)
from .flatten import flatten_base
from .inject import inject_chain
from .pagemap import (
    PAGE_SIZE,
    Vma,
    find_vma,
    scan_private,
    scan_private_ioctl,
    scan_private_pagemap,
)
from .snapshot import (
    MemSnapshot,
    RestoreStats,
    config_digest,
    restore_base_into,
    restore_into,
    snapshot_incremental,
)

__all__ = [
    "PAGE_SIZE",
    "BaseImage",
    "Capture",
    "CaptureBuffer",
    "CorruptSnapshotError",
    "DiffChain",
    "DiffFile",
    "DiffHeader",
    "DiffKind",
    "MemSnapError",
    "MemSnapshot",
    "RestoreStats",
    "SnapshotMismatchError",
    "UnsupportedStreamError",
    "Vma",
    "capture_private",
    "check_device_stream",
    "compact",
    "config_digest",
    "copy_sparse_hashing",
    "delta_pages",
    "find_vma",
    "flatten_base",
    "freeze_base",
    "hash_file",
    "inject_chain",
    "load_device_state",
    "parse_header",
    "parse_ram_prefix",
    "restore_base_into",
    "restore_into",
    "save_device_state",
    "save_template",
    "scan_private",
    "scan_private_ioctl",
    "scan_private_pagemap",
    "snapshot_incremental",
    "splice",
    "verify_base",
    "write_cumulative",
    "write_delta",
    "write_diff",
]
