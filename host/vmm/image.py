"""Locate the built guest kernel and rootfs images (`make kernel`, `make image`).

Cache layout (written by kernel/build.sh and rootfs/build.sh):

    $AENV_CACHE/kernel/current -> <hash>/{vmlinux, bzImage, info.json, DONE}
    $AENV_CACHE/images/<name>/{rootfs.ext4, manifest.json (rootfs, layers, kernel, cmdline)}
    $AENV_CACHE/images/current -> <name>

`find_image()` reads a manifest and returns a `GuestImage`; `image.vm_spec(root=
image.overlay(path))` gives a ready-to-start `VmSpec` with a private writable root disk.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .driver import Disk, FileDisk, VmSpec
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
class GuestImage:
    """A built image: the bootable root disk, its kernel and kernel command line."""

    name: str
    dir: Path
    manifest: dict[str, Any]
    kernel: GuestKernel
    rootfs: Path  # raw ext4 booted as /dev/vda; shared by all VMs: never write into it
    cmdline: str  # without tsc_early_khz: the driver adds it under TCG only

    def overlay(self, dest: Path) -> FileDisk:
        """A per-VM writable root disk: a qcow2 overlay over the shared rootfs (instant,
        only the VM's writes take space)."""
        try:
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw",
                            "-b", str(self.rootfs), str(dest)],
                           check=True, capture_output=True, timeout=30)
        except subprocess.CalledProcessError as exc:
            raise VmmError(f"qemu-img create {dest} failed: {exc.stderr.decode().strip()}") \
                from exc
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise VmmError(f"qemu-img create {dest} failed: {exc}") from exc
        return FileDisk(path=dest, format="qcow2", backing=self.rootfs)

    def vm_spec(self, *, root: Disk, **kw: Any) -> VmSpec:
        """A `VmSpec` booting this image from `root` (e.g. `overlay()`, or an NBD export
        of a writable layer stack). Other keyword arguments go to `VmSpec`; `cmdline`
        there is appended to the image's command line."""
        extra = kw.pop("cmdline", "")
        cmdline = f"{self.cmdline} {extra}".strip()
        return VmSpec(kernel=self.kernel.vmlinux, cmdline=cmdline, disks=(root,), **kw)


def _kernel_for(manifest: dict[str, Any], cache: Path) -> GuestKernel:
    k = manifest.get("kernel")
    if isinstance(k, dict) and k.get("dir") and Path(k["dir"], "DONE").exists():
        return GuestKernel.from_dir(Path(k["dir"]))
    return find_kernel(cache)


def _strip_placeholders(cmdline: str) -> str:
    # the manifest carries `tsc_early_khz={tsc_khz}`: host-specific, filled by the driver
    return " ".join(tok for tok in cmdline.split() if "{" not in tok)


def find_image(name: str | None = None, cache: Path | None = None) -> GuestImage:
    """The image `name` (default $AENV_IMAGE, else `images/current`, else `default`)."""
    cache = cache or cache_dir()
    images = cache / "images"
    name = name or os.environ.get("AENV_IMAGE")
    if name is None:
        current = images / "current"
        name = current.resolve().name if current.is_symlink() else "default"
    d = images / name
    mpath = d / "manifest.json"
    if not mpath.is_file():
        raise ImageNotFound(f"{mpath} missing (run `make image`)")
    manifest = json.loads(mpath.read_text())
    rootfs = Path(manifest.get("rootfs", {}).get("path") or d / "rootfs.ext4")
    if not rootfs.is_file():
        raise ImageNotFound(f"image {name}: {rootfs} missing (run `make image`)")
    return GuestImage(name=name, dir=d, manifest=manifest, kernel=_kernel_for(manifest, cache),
                      rootfs=rootfs, cmdline=_strip_placeholders(str(manifest.get("cmdline", ""))))


def build(targets: tuple[str, ...] = ("kernel", "image"), *, repo: Path = REPO,
          timeout_s: float = 3600) -> None:
    """Run `make <targets>` (cached by their inputs, so cheap when nothing changed)."""
    try:
        subprocess.run(["make", *targets], cwd=repo, check=True, timeout=timeout_s,
                       stdin=subprocess.DEVNULL)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise VmmError(f"`make {' '.join(targets)}` failed: {exc}") from exc
