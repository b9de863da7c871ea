"""The README's test command builds what VM tests need, and a VM test that finds it missing
fails (a suite that skipped them all would pass while testing nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_make_test_builds_kernel_and_image_first():
    out = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    kernel = next(i for i, line in enumerate(lines) if "kernel/build.sh" in line)
    image = next(i for i, line in enumerate(lines) if "rootfs/build.sh" in line)
    pytest_run = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert kernel < image < pytest_run, out


def test_a_vm_test_fails_without_the_image(tmp_path: Path):
    env = {**os.environ, "AENV_CACHE": str(tmp_path / "empty-cache")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/build/test_kernel_image.py::test_manifest_describes_layers"],
                       cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "1 failed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
    assert "run `make kernel image`" in r.stdout, r.stdout[-2000:]
