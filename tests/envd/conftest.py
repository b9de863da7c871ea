"""A real envd for SDK tests, reached by the e2b SDKs in debug mode (`E2B_DEBUG=true`).

The daemon listens on 127.0.0.1:49983 (the SDKs' debug-mode default) when that port is
free. When it is taken (another suite running in parallel on this machine), it listens
on a free port instead and `sdk_env` / `sdk_environ` point the SDKs at it with
`E2B_SANDBOX_URL`, so parallel suites never share (or kill) each other's daemon.

Runs the unfrozen daemon (`python -m envd`) by default; set ENVD_BIN=out/envd to run
the same tests against the frozen executable.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

ENVD_PORT = 49983  # the SDKs' debug-mode envd port
ENVD_URL = f"http://127.0.0.1:{ENVD_PORT}"
REPO = Path(__file__).resolve().parents[2]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envd exited early with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=0.5).status_code == 204:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError("envd did not become healthy")


@pytest.fixture(scope="session")
def envd_process():
    """The envd process (session-scoped), owned by this session. Yields the Popen object;
    its URL is `proc.url`. Killed (process group) at the end of the session."""
    binary = os.environ.get("ENVD_BIN")
    port = ENVD_PORT if _port_is_free(ENVD_PORT) else _free_port()
    argv = [binary] if binary else [sys.executable, "-m", "envd"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--default-user", "user"]
    proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True)
    proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        _wait_healthy(proc, proc.url)  # type: ignore[attr-defined]
        time.sleep(0.1)
        if proc.poll() is not None:  # lost a bind race: someone else answered /health
            raise RuntimeError(f"envd exited early with {proc.returncode}")
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
    return envd_process.url


def sdk_environ(envd_url: str) -> dict[str, str]:
    """Environment variables that point an e2b SDK (Python or JS) at `envd_url`."""
    env = {"E2B_DEBUG": "true", "E2B_API_KEY": "x"}
    if envd_url != ENVD_URL:
        env["E2B_SANDBOX_URL"] = envd_url
    return env


@pytest.fixture
def sdk_env(envd_url, monkeypatch):
    """Point the e2b SDK at this session's envd in debug mode."""
    monkeypatch.delenv("E2B_SANDBOX_URL", raising=False)
    for key, value in sdk_environ(envd_url).items():
        monkeypatch.setenv(key, value)
    return envd_url


@pytest.fixture
def home_dir(request):
    """A fresh directory under /home/user owned by `user` (named after the test module);
    removed afterwards."""
    user = pwd.getpwnam("user")
    stem = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    path = Path(user.pw_dir) / f"{stem}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    os.chown(path, user.pw_uid, user.pw_gid)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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

    def start(self) -> InProcessEnvd:
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
