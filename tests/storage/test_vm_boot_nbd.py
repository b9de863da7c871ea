"""Boot a real microVM from a layered image served by our block server over NBD.

Uses what `make kernel image` built (skipped when absent): base.ext4 becomes the base
layer, rootfs.ext4 a delta layer over it (convert --base), a stack with a fresh upper goes
to QEMU as `-drive file.driver=nbd,...`, and the guest must answer envd /health. Then the
disk is sealed (the guest's writes become a layer) and a clone boots from it too.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from host.storage.control import StackInfo
from host.storage.convert import convert_image
from host.vmm.qemu.cmdline import MACHINE
from tests.vmassets import require_vm_assets

from .conftest import BlockServerProc, free_port

pytestmark = [pytest.mark.vm, pytest.mark.slow]

CACHE = Path(os.environ.get("AENV_CACHE", "/var/cache/aenv"))


def _manifest() -> dict[str, Any]:
    man = require_vm_assets()
    base = [layer for layer in man["layers"] if layer["name"] == "base"]
    if not base or not Path(base[0]["path"]).exists() or not Path(man["rootfs"]["path"]).exists():
        pytest.fail("the image manifest lacks base.ext4/rootfs.ext4: run `make image`",
                    pytrace=False)
    return man


def _tsc_khz() -> int:
    out = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout
    m = re.search(r"tsc: Refined TSC clocksource calibration: ([0-9.]+) MHz", out) or re.search(
        r"tsc: Detected ([0-9.]+) MHz", out)
    if m:
        return int(float(m.group(1)) * 1000)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    raise RuntimeError("no TSC frequency")


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, urllib.error.URLError):
        return None


def _boot(man: dict[str, Any], info: StackInfo, work: Path, timeout_s: float = 240) -> float:
    """Boot, wait for envd /health == 204, power off; returns seconds to health."""
    port = free_port()
    console = work / f"console-{info.name}.log"
    argv = [
        "qemu-system-x86_64", "-M", MACHINE, "-accel", "tcg", "-cpu", "max", "-smp", "2",
        "-m", "1G", "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", man["kernel"]["vmlinux"],
        "-append", man["cmdline"].format(tsc_khz=_tsc_khz()),
        "-serial", f"file:{console}",
        "-drive", info.qemu_drive("root"),
        "-device", "virtio-blk-device,drive=root",
        "-netdev", f"user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:49983",
        "-device", "virtio-net-device,netdev=net0",
        "-device", "virtio-rng-device",
    ]
    t0 = time.monotonic()
    qemu = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        while _health(f"http://127.0.0.1:{port}") != 204:
            if qemu.poll() is not None:
                err = qemu.stderr.read().decode() if qemu.stderr else ""
                pytest.fail(f"qemu exited {qemu.returncode}: {err}\n"
                            f"{console.read_text(errors='replace')[-3000:]}")
            if time.monotonic() - t0 > timeout_s:
                pytest.fail(f"no envd /health within {timeout_s}s:\n"
                            f"{console.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        return time.monotonic() - t0
    finally:
        if qemu.poll() is None:
            qemu.terminate()
            try:
                qemu.wait(timeout=10)
            except subprocess.TimeoutExpired:
                qemu.kill()
                qemu.wait()


def test_vm_boots_from_layered_image_over_nbd(tmp_path: Path) -> None:
    man = _manifest()
    base_img = next(la["path"] for la in man["layers"] if la["name"] == "base")
    out = tmp_path / "layers"
    out.mkdir()
    bpath, bdigest, _ = convert_image(base_img, out)
    tpath, tdigest, _ = convert_image(man["rootfs"]["path"], out, base=base_img)

    bs = BlockServerProc(tmp_path / "bs", repo=f"posix_fs:{tmp_path / 'repo'}")
    bs.root.mkdir()
    bs.start()
    try:
        c = bs.client
        assert c.import_layer(str(bpath)) == bdigest
        assert c.import_layer(str(tpath)) == tdigest
        info = c.create("vm0", [bdigest, tdigest])
        secs = _boot(man, info, tmp_path)
        print(f"envd healthy after {secs:.1f}s booting from NBD")
        snap = c.seal("vm0")  # the guest's writes (journal, logs) become layer 3
        kid = c.clone("vm0", "vm1")
        assert kid.layers == (bdigest, tdigest, snap)
        _boot(man, kid, tmp_path)
        assert bs.alive()
    finally:
        bs.stop()
