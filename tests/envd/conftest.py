"""A real envd on 127.0.0.1:49983 for SDK tests (`E2B_DEBUG=true` reaches it).

Runs the unfrozen daemon (`python -m envd`) by default; set ENVD_BIN=out/envd to run
the same tests against the frozen executable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ENVD_PORT = 49983
ENVD_URL = f"http://127.0.0.1:{ENVD_PORT}"
REPO = Path(__file__).resolve().parents[2]


def _wait_healthy(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envd exited early with {proc.returncode}")
        try:
            if httpx.get(f"{ENVD_URL}/health", timeout=0.5).status_code == 204:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError("envd did not become healthy")


@pytest.fixture(scope="session")
def envd_process():
    """The envd process (session-scoped). Yields the Popen object."""
    binary = os.environ.get("ENVD_BIN")
    argv = [binary] if binary else [sys.executable, "-m", "envd"]
    argv += ["--host", "127.0.0.1", "--port", str(ENVD_PORT), "--default-user", "user"]
    proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True)
    try:
        _wait_healthy(proc)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="session")
def envd_url(envd_process) -> str:
    return ENVD_URL


@pytest.fixture
def sdk_env(envd_url, monkeypatch):
    """Point the e2b SDK at the local envd in debug mode."""
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.delenv("E2B_SANDBOX_URL", raising=False)
    return envd_url
