"""Fixtures for the proxy tests: a REAL envd process, user-side upstream servers, and the
proxy + REST API (over the in-memory orchestrator double, whose `route()` points at those
local servers) served by uvicorn on loopback ports. Everything started here is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from host.api import ApiKeys, build_api_app
from host.proxy import build_proxy_app
from tests.api.conftest import API_KEY, ServerThread, free_port
from tests.api.double import FakeOrchestrator

REPO = Path(__file__).resolve().parents[2]
DOMAIN = "sbx.test"


def start_process(argv: list[str], *, cwd: Path = REPO,
                  health: str | None = None) -> subprocess.Popen:
    # stderr to a file, not a pipe nobody drains (a full pipe would block the child)
    log = tempfile.TemporaryFile()  # noqa: SIM115 - owned by the process, closed by its stopper
    proc = subprocess.Popen(argv, cwd=cwd, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=log)
    proc.log = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + 20
    while health is not None:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{argv} exited early: {log.read().decode()[-2000:]}")
        try:
            if httpx.get(health, timeout=0.5).status_code < 500:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise TimeoutError(f"{argv} did not become ready")
        time.sleep(0.05)
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = getattr(proc, "log", None)
    if log is not None:
        log.close()


@pytest.fixture(scope="session")
def envd_port() -> Iterator[int]:
    port = free_port()
    proc = start_process([sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port",
                          str(port), "--default-user", os.environ.get("ENVD_TEST_USER", "user")],
                         health=f"http://127.0.0.1:{port}/health")
    try:
        yield port
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def http_server(tmp_path_factory) -> Iterator[tuple[int, Path]]:
    """`python -m http.server` serving a temp dir on a loopback port."""
    root = tmp_path_factory.mktemp("www")
    (root / "hello.txt").write_text("hello from the sandbox\n")
    port = free_port()
    proc = start_process([sys.executable, "-m", "http.server", str(port), "--bind",
                          "127.0.0.1", "--directory", str(root)],
                         health=f"http://127.0.0.1:{port}/hello.txt")
    try:
        yield port, root
    finally:
        stop_process(proc)


@pytest.fixture
def orch(envd_port: int) -> Iterator[FakeOrchestrator]:
    o = FakeOrchestrator(domain=DOMAIN)
    o.upstream = ("127.0.0.1", envd_port)
    yield o
    o.close()  # its template node keeps a state dir


@pytest.fixture
def servers(orch: FakeOrchestrator) -> Iterator[tuple[ServerThread, ServerThread]]:
    """(api, proxy): the proxy also serves api.<domain> through the API app."""
    api_app = build_api_app(orch, ApiKeys([API_KEY]), domain=DOMAIN)
    proxy_app = build_proxy_app(orch, DOMAIN, api_app=api_app)
    with ServerThread(api_app) as api, ServerThread(proxy_app, lifespan="on") as proxy:
        yield api, proxy


@pytest.fixture
def proxy_url(servers) -> str:
    return servers[1].url
