"""Kernel config, guest init and image manifest checks, plus one real boot of the image.
Those that need the built kernel and image are marked vm and fail without them
(tests/vmassets.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vmassets import require_vm_assets

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("AENV_CACHE", "/var/cache/aenv"))
FRAGMENT = REPO / "kernel" / "microvm.config"


def _kernel_dir() -> Path | None:
    r = subprocess.run([str(REPO / "kernel" / "build.sh"), "--print-path"],
                       capture_output=True, text=True, check=False)
    return Path(r.stdout.strip()) if r.returncode == 0 else None


def test_fragment_is_well_formed():
    seen = set()
    for line in FRAGMENT.read_text().splitlines():
        if not line.strip() or (line.startswith("#") and not line.startswith("# CONFIG_")):
            continue
        m = re.fullmatch(r"(CONFIG_[A-Z0-9_]+)=.+|# (CONFIG_[A-Z0-9_]+) is not set", line)
        assert m, f"bad fragment line: {line!r}"
        sym = m.group(1) or m.group(2)
        assert sym not in seen, f"duplicate {sym}"
        seen.add(sym)
    for must in ("CONFIG_PVH", "CONFIG_VIRTIO_MMIO", "CONFIG_VIRTIO_BLK", "CONFIG_VIRTIO_NET",
                 "CONFIG_VIRTIO_BALLOON", "CONFIG_PAGE_REPORTING", "CONFIG_VIRTIO_VSOCKETS",
                 "CONFIG_EXT4_FS", "CONFIG_OVERLAY_FS", "CONFIG_EROFS_FS", "CONFIG_FUSE_FS",
                 "CONFIG_SERIAL_8250_CONSOLE", "CONFIG_DEVTMPFS_MOUNT", "CONFIG_MODULES"):
        assert must in seen, must


@pytest.mark.vm  # needs what `make kernel` built (make test builds it; test-fast skips it)
def test_built_kernel_has_every_fragment_option():
    require_vm_assets()
    kdir = _kernel_dir()
    assert kdir is not None, "kernel/build.sh --print-path: no kernel built for these inputs"
    config = (kdir / "config").read_text().splitlines()
    for line in FRAGMENT.read_text().splitlines():
        if line.startswith("CONFIG_"):
            assert line in config, f"{line} missing from {kdir}/config"
        elif line.endswith(" is not set") and line.startswith("# CONFIG_"):
            sym = line.split()[1]
            assert not any(c.startswith(sym + "=") for c in config), f"{sym} is set"
    assert (kdir / "DONE").exists() and (kdir / "vmlinux").stat().st_size > 1_000_000
    # vmlinux must carry the PVH entry note (Xen ELF note type 18) for QEMU/Firecracker
    notes = subprocess.run(["readelf", "-n", str(kdir / "vmlinux")], capture_output=True,
                           text=True, check=False).stdout
    assert "Xen" in notes and ("PHYS32_ENTRY" in notes or "0x00000012" in notes), notes[-800:]


@pytest.mark.vm  # needs what `make kernel` built
def test_built_kernel_carries_our_patches():
    """kernel/patches: the free-page reporting delay is a parameter of the built kernel
    (the host's guests set it on their command line, host/vmm/driver.py)."""
    require_vm_assets()
    kdir = _kernel_dir()
    assert kdir is not None
    symbols = (kdir / "System.map").read_text()
    assert "__param_page_reporting_delay_ms" in symbols
    shipped = sorted(p.name for p in kdir.glob("*.patch"))
    assert shipped == sorted(p.name for p in (REPO / "kernel" / "patches").glob("*.patch"))


def test_init_compiles_static_without_warnings(tmp_path):
    if not shutil.which("gcc"):
        pytest.skip("no gcc")
    out = tmp_path / "init"
    subprocess.run(["gcc", "-static", "-Os", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    str(REPO / "rootfs" / "init" / "init.c")], check=True)
    r = subprocess.run(["ldd", str(out)], capture_output=True, text=True, check=False)
    assert "not a dynamic executable" in r.stdout + r.stderr


@pytest.mark.vm  # needs what `make image` built
def test_manifest_describes_layers():
    m = require_vm_assets()
    assert m["format_version"] == 1
    assert [layer["name"] for layer in m["layers"]] == ["base", "envd"]
    for entry in [m["rootfs"], *m["layers"]]:
        p = Path(entry["path"])
        assert p.exists(), p
        assert entry["size"] == p.stat().st_size
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", entry["digest"])
    assert "{tsc_khz}" in m["cmdline"] and "root=/dev/vda" in m["cmdline"]
    assert m["envd"]["path"] == "/usr/bin/envd"
    if m["kernel"]:
        assert Path(m["kernel"]["vmlinux"]).exists()
    # the merged rootfs holds the init and the frozen envd
    ls = subprocess.run(["debugfs", "-R", "ls -l /usr/sbin", m["rootfs"]["path"]],
                        capture_output=True, text=True, check=False).stdout
    assert "aenv-init" in ls


@pytest.mark.vm
@pytest.mark.slow
def test_image_boots_and_envd_answers():
    require_vm_assets()
    r = subprocess.run([sys.executable, str(REPO / "rootfs" / "boot-check.py"), "--timeout",
                        "240"], capture_output=True, text=True, timeout=400, check=False)
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "health: 204" in r.stdout and "uid=1000(user)" in r.stdout
