"""Locate the built guest kernel and rootfs images (`make kernel`, `make image`).

Cache layout (written by kernel/build.sh and rootfs/build.sh):

    $AENV_CACHE/kernel/current -> <hash>/{vmlinux, bzImage, info.json, DONE}
    $AENV_CACHE/images/<name>/manifest.json   (layers, kernel, cmdline)

`find_image()` reads a manifest and returns a `GuestImage` whose `vm_spec()` gives a
ready-to-start `VmSpec` (read-only base layers first, then a writable upper).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .driver import FileDisk, VmSpec
from .errors import VmmError

REPO = Path(__file__).resolve().parents[2]


class ImageNotFound(VmmError):
    """The kernel or image has not been built (run `make kernel image`)."""


def cache_dir() -> Path:
    return Path(os.environ.get("AENV_CACHE", "/var/cache/aenv"))


@dataclass(frozen=True, kw_only=True)
class GuestKernel:
    dir: Path
    vmlinux: Path  # PVH ELF: what QEMU microvm and Firecracker boot
    bzimage: Path | None
    release: str  # `uname -r` inside the guest

    @classmethod
    def from_dir(cls, d: Path) -> GuestKernel:
        d = d.resolve()
        if not (d / "DONE").exists() or not (d / "vmlinux").is_file():
            raise ImageNotFound(f"no finished kernel build in {d} (run `make kernel`)")
        info: dict[str, Any] = {}
        if (d / "info.json").is_file():
            info = json.loads((d / "info.json").read_text())
        bz = d / "bzImage"
        return cls(dir=d, vmlinux=d / "vmlinux", bzimage=bz if bz.is_file() else None,
                   release=str(info.get("kernel_release", "")))


def find_kernel(cache: Path | None = None) -> GuestKernel:
    """The kernel `make kernel` last built or reused (`kernel/current`)."""
    return GuestKernel.from_dir((cache or cache_dir()) / "kernel" / "current")


@dataclass(frozen=True, kw_only=True)
class Layer:
    path: Path
    read_only: bool
    format: str = "raw"
    name: str | None = None


@dataclass(frozen=True, kw_only=True)
class GuestImage:
    name: str
    dir: Path
    manifest: dict[str, Any]
    kernel: GuestKernel
    cmdline: str
    layers: tuple[Layer, ...]

    def vm_spec(self, *, disks: tuple[FileDisk, ...] | None = None, **kw: Any) -> VmSpec:
        """A `VmSpec` booting this image. By default the layers are attached as they are
        (a writable layer is written in place: give per-VM copies via `disks` or use
        `with_upper()`). Other keyword arguments go to `VmSpec`."""
        if disks is None:
            disks = tuple(FileDisk(path=lay.path, read_only=lay.read_only, format=lay.format,
                                   serial=lay.name) for lay in self.layers)
        return VmSpec(kernel=self.kernel.vmlinux, cmdline=self.cmdline, disks=disks, **kw)

    def with_kernel(self, kernel: GuestKernel) -> GuestImage:
        return replace(self, kernel=kernel)


def _layer(entry: Any, image_dir: Path) -> Layer:
    if isinstance(entry, str):
        entry = {"path": entry}
    raw = entry.get("path") or entry.get("file")
    if not raw:
        raise ImageNotFound(f"manifest layer without a path: {entry}")
    path = Path(raw)
    if not path.is_absolute():
        path = image_dir / path
    ro = entry.get("read_only", entry.get("readonly", entry.get("role") != "upper"))
    fmt = entry.get("format", "raw")
    if fmt in ("ext4", "erofs"):  # file system type, not a QEMU image format
        fmt = "raw"
    return Layer(path=path, read_only=bool(ro), format=fmt, name=entry.get("name"))


def _kernel_for(manifest: dict[str, Any], cache: Path) -> GuestKernel:
    k = manifest.get("kernel")
    if isinstance(k, dict):
        k = k.get("dir") or k.get("path") or k.get("vmlinux") or k.get("hash")
    if isinstance(k, str) and k:
        p = Path(k)
        if not p.is_absolute():
            p = cache / "kernel" / k
        if p.name in ("vmlinux", "bzImage"):
            p = p.parent
        if p.exists():
            return GuestKernel.from_dir(p)
    return find_kernel(cache)


def find_image(name: str | None = None, cache: Path | None = None) -> GuestImage:
    """The image `name` (default $AENV_IMAGE, else the only/`default`/`base` image)."""
    cache = cache or cache_dir()
    images = cache / "images"
    name = name or os.environ.get("AENV_IMAGE")
    if name is None:
        built = sorted(p.parent.name for p in images.glob("*/manifest.json"))
        for preferred in ("default", "base"):
            if preferred in built:
                name = preferred
                break
        else:
            if not built:
                raise ImageNotFound(f"no image in {images} (run `make image`)")
            name = built[0]
    d = images / name
    mpath = d / "manifest.json"
    if not mpath.is_file():
        raise ImageNotFound(f"{mpath} missing (run `make image`)")
    manifest = json.loads(mpath.read_text())
    layers = tuple(_layer(e, d) for e in manifest.get("layers", []))
    for lay in layers:
        if not lay.path.exists():
            raise ImageNotFound(f"image {name}: layer {lay.path} missing")
    return GuestImage(name=name, dir=d, manifest=manifest, kernel=_kernel_for(manifest, cache),
                      cmdline=str(manifest.get("cmdline", "")), layers=layers)


def build(targets: tuple[str, ...] = ("kernel", "image"), *, repo: Path = REPO,
          timeout_s: float = 3600) -> None:
    """Run `make <targets>` (cached by their inputs, so cheap when nothing changed)."""
    try:
        subprocess.run(["make", *targets], cwd=repo, check=True, timeout=timeout_s,
                       stdin=subprocess.DEVNULL)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise VmmError(f"`make {' '.join(targets)}` failed: {exc}") from exc
