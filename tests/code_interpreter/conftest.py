"""The code-interpreter server (templates/code-interpreter/server) as a real process on
127.0.0.1:49999, the port the e2b code-interpreter SDKs reach in debug mode.

Fixtures, from the bottom:

    guest_python   an interpreter like the guest's: a --without-pip venv of the base
                   CPython 3.11 whose site-packages holds only a .pth naming the template's
                   pinned package tree (host/builtin/pydeps.ensure_tree, built once under
                   $AENV_CACHE) and the server's source; nothing of the repo's .venv leaks
                   in, and the kernels the server spawns (sys.executable) get the same view
    fake_envd      a stdlib HTTP server standing in for envd's GET /envs (sandbox env vars)
    ci_server      the server process (session-wide), healthy = default kernel warm
    sdk_sandbox    an e2b_code_interpreter.Sandbox in debug mode (no API call is made)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from host.builtin.pydeps import ensure_tree

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "templates" / "code-interpreter"
PORT = 49999
URL = f"http://127.0.0.1:{PORT}"
ENVD_TOKEN = "ci-test-token"
KEEPALIVE_S = 1.0
SANDBOX_ENVS = {"AENV_SANDBOX_VAR": "from-envd", "AENV_SHARED_VAR": "sandbox-wide"}


@pytest.fixture(scope="session")
def guest_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A python3 seeing the stdlib, the template's package tree and the server only."""
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the guest tree is built for CPython 3.11")
    cache = Path(os.environ.get("AENV_CACHE", "/var/cache/aenv"))
    site = asyncio.run(ensure_tree(TEMPLATE / "requirements.txt", cache))
    root = tmp_path_factory.mktemp("guest-venv")
    # the base interpreter, not .venv's: a venv made from a venv would chain to it
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True,
                   capture_output=True)
    python = root / "bin" / "python3"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "aenv-guest.pth").write_text(f"{site}\n{TEMPLATE / 'server'}\n")
    return python


@dataclass
class FakeEnvd:
    """GET /envs answers `envs` (401 without the token); records the tokens it saw."""

    url: str
    envs: dict[str, str] = field(default_factory=lambda: dict(SANDBOX_ENVS))
    tokens: list[str | None] = field(default_factory=list)


@pytest.fixture(scope="session")
def fake_envd() -> Iterator[FakeEnvd]:
    state = FakeEnvd(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            token = self.headers.get("X-Access-Token")
            state.tokens.append(token)
            if self.path != "/envs":
                self.send_error(404)
                return
            if token not in (None, ENVD_TOKEN):
                self.send_error(401)
                return
            body = json.dumps(state.envs).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@dataclass(frozen=True)
class CIServer:
    url: str
    home: Path       # the default cwd of contexts
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        # as uvicorn binds: connections of an earlier run in TIME_WAIT do not count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.fixture(scope="session")
def ci_server(guest_python: Path, fake_envd: FakeEnvd,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[CIServer]:
    """The server on 127.0.0.1:49999, answering /health (its default kernel is warm)."""
    if _port_taken(PORT):
        pytest.fail(f"127.0.0.1:{PORT} is taken: the code-interpreter SDKs' debug mode only "
                    "reaches that port; stop whatever listens there (ss -ltnp sport = :49999)")
    work = tmp_path_factory.mktemp("ci-server")
    home = work / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "E2B_", "AENV_"))}
    env.update({
        "AENV_CI_HOST": "127.0.0.1", "AENV_CI_PORT": str(PORT), "AENV_CI_CWD": str(home),
        "AENV_CI_ENVD_URL": fake_envd.url,
        # keepalive lines in most streams: the SDKs must skip them
        "AENV_CI_KEEPALIVE_S": str(KEEPALIVE_S),
        # keep IPython's and matplotlib's per-user state out of the real $HOME
        "IPYTHONDIR": str(work / "ipython"), "MPLCONFIGDIR": str(work / "mpl"),
    })
    log_path = work / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(guest_python), "-m", "aenv_code_interpreter"], cwd=work,
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = CIServer(url=URL, home=home, log=log_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if httpx.get(f"{URL}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer /health:\n{server.log_tail()}")
            time.sleep(0.1)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)    # lifespan shutdown kills the kernels
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture
def sdk_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDKs' debug mode, nothing redirecting them elsewhere."""
    for key in list(os.environ):
        if key.startswith("E2B_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_API_KEY", "e2b_unused_in_debug_mode")


@pytest.fixture
def sandbox(ci_server: CIServer, sdk_env: None) -> object:
    """An e2b_code_interpreter.Sandbox in debug mode: its jupyter URL is
    http://localhost:49999 and creating it calls no API."""
    ci = pytest.importorskip("e2b_code_interpreter")
    return ci.Sandbox.create()
