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


class InProcessEnvd:
    """An envd app served by uvicorn in a thread of the test process, on a free port.

    Unlike the shared :49983 daemon, its `app.state.defaults` can be changed directly
    (e.g. to set an access token) and its services inspected.
    """

    def __init__(self) -> None:
        import socket
        import threading

        import uvicorn

        from envd.app import build_app
        from envd.config import EnvdConfig

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(EnvdConfig(host="127.0.0.1", port=self.port, default_user="user"))
        self.defaults = self.app.state.defaults
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning",
            timeout_graceful_shutdown=5, lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, name="envd-inprocess", daemon=True)

    def start(self) -> "InProcessEnvd":
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("in-process envd did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


@pytest.fixture(scope="module")
def inprocess_envd():
    """A private envd (uvicorn thread, free port) whose Defaults the test may mutate.

    Guarantees: started before the test module, stopped (and its processes killed by
    the app lifespan) after it.
    """
    server = InProcessEnvd().start()
    try:
        yield server
    finally:
        server.stop()


# -- Connect wire helpers (raw protocol tests) -----------------------------------------
STREAM_HEADERS = {"content-type": "application/connect+json", "connect-protocol-version": "1"}
UNARY_HEADERS = {"content-type": "application/json", "connect-protocol-version": "1"}


def envelope(message: dict | bytes, flags: int = 0) -> bytes:
    """One Connect envelope: flags byte, big-endian length, JSON payload."""
    import json

    payload = message if isinstance(message, bytes) else json.dumps(message).encode()
    return bytes([flags]) + len(payload).to_bytes(4, "big") + payload


def split_envelopes(body: bytes) -> list[tuple[int, bytes]]:
    """Parse a Connect stream body into (flags, payload) pairs; raises on trailing junk."""
    frames = []
    i = 0
    while i < len(body):
        if len(body) - i < 5:
            raise ValueError(f"truncated envelope header at {i}")
        flags, length = body[i], int.from_bytes(body[i + 1:i + 5], "big")
        payload = body[i + 5:i + 5 + length]
        if len(payload) != length:
            raise ValueError("truncated envelope payload")
        frames.append((flags, payload))
        i += 5 + length
    return frames
