"""The frozen envd (out/envd): fully static, self-contained, and protocol-complete."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
SDK_PORT = 49983  # tests/envd/conftest.py starts envd on this fixed port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_health(proc: subprocess.Popen, url: str, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"frozen envd exited with {proc.returncode}: {out[-2000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=0.5).status_code
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("frozen envd did not answer /health")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_is_static(frozen_envd):
    r = subprocess.run(["ldd", str(frozen_envd)], capture_output=True, text=True, check=False)
    assert "not a dynamic executable" in (r.stdout + r.stderr), r.stdout + r.stderr


def test_serves_health_and_rpc(frozen_envd, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(frozen_envd), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        assert _wait_health(proc, url) == 204
        (tmp_path / "hello.txt").write_text("hi")
        # a Connect unary RPC (JSON codec): proves connectrpc + protobuf-py are bundled
        r = httpx.post(f"{url}/filesystem.Filesystem/Stat",
                       json={"path": str(tmp_path / "hello.txt")},
                       headers={"Authorization": "Basic cm9vdDo="}, timeout=10)  # root:
        assert r.status_code == 200, r.text
        assert r.json()["entry"]["name"] == "hello.txt"
    finally:
        _stop(proc)


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot and mounting /proc need root")
def test_runs_in_empty_chroot(frozen_envd):
    """Only the binary, /tmp and /proc: nothing from a libc or a Python install."""
    root = Path(tempfile.mkdtemp(prefix="envd-chroot-"))
    proc_dir = root / "proc"
    mounted = False
    try:
        shutil.copy2(frozen_envd, root / "envd")
        (root / "tmp").mkdir(mode=0o1777)
        proc_dir.mkdir()
        subprocess.run(["mount", "-t", "proc", "proc", str(proc_dir)], check=True)
        mounted = True
        assert sorted(p.name for p in root.iterdir()) == ["envd", "proc", "tmp"]
        port = _free_port()
        proc = subprocess.Popen(["chroot", str(root), "/envd", "--host", "127.0.0.1",
                                 "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            assert _wait_health(proc, f"http://127.0.0.1:{port}") == 204
        finally:
            _stop(proc)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(proc_dir)], check=False)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_envd_suite_passes_against_frozen_binary(frozen_envd):
    """`ENVD_BIN=out/envd pytest tests/envd`: the SDK-level envd tests, frozen binary."""
    if os.environ.get("ENVD_BIN"):
        pytest.skip("already running with ENVD_BIN set (no recursion)")
    if _port_busy(SDK_PORT):
        pytest.skip(f"port {SDK_PORT} is busy (an envd from this session?); run "
                    f"`ENVD_BIN=out/envd pytest tests/envd` on its own")
    env = dict(os.environ, ENVD_BIN=str(frozen_envd))

    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p",
                               "no:cacheprovider", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=560, check=False)

    r = pytest_run("tests/envd")
    tail = (r.stdout + r.stderr)[-4000:]
    print(tail)
    if r.returncode == 1:
        # timing-sensitive envd tests can flake on a loaded 2-core host: rerun only the
        # failures once, in isolation; a real freezing defect fails again.
        failed = re.findall(r"^FAILED (\S+::\S+)", r.stdout, re.MULTILINE)
        assert failed, tail
        print(f"rerunning {len(failed)} failed test(s) once: {failed}")
        r = pytest_run(*failed)
        tail = (r.stdout + r.stderr)[-4000:]
        print(tail)
    assert r.returncode == 0, tail
