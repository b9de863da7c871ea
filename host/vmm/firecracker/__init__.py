"""The Firecracker driver: one `firecracker` process per VM (optionally under its
`jailer`), configured over its REST API; disks as NBD kernel block devices."""

from __future__ import annotations

from .config import BalloonConfig, firecracker_usable
from .driver import FirecrackerDriver
from .jailer import JailerConfig, find_jailer
from .vm import FirecrackerVm

__all__ = ["BalloonConfig", "FirecrackerDriver", "FirecrackerVm", "JailerConfig",
           "find_jailer", "firecracker_usable"]
