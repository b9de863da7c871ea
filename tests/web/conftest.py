"""Fixtures for the web terminal tests.

What is real: the REST API, the sandbox proxy with its web terminal (host/web), envd
(`python -m envd`, a real process: the terminal's shell is a real PTY), Debian's chromium
driven by Playwright, and xterm.js as `make web` vendors it. What is not: the sandbox
LIFECYCLE is the orchestrator test double of tests/api/double.py (no VM; its pause ends
the proxy's routes like a real pause does). tests/e2e/test_web_terminal.py repeats the
browser session against a real VM.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from host.api import ApiKeys, build_api_app
from host.proxy import build_proxy_app
from host.web.links import TerminalLinks
from host.web.terminal import vendored
from tests.api.conftest import API_KEY, ServerThread
from tests.api.double import FakeOrchestrator
from tests.proxy.conftest import DOMAIN, envd_port, orch  # noqa: F401 (fixtures)

CHROMIUM = shutil.which("chromium")


def require_browser() -> str:
    """The chromium binary; the suite needs it and the vendored xterm.js (`make setup`
    installs chromium, `make web` vendors xterm.js): missing ones fail, they never skip."""
    assert CHROMIUM, "chromium is not installed: run `make setup`"
    assert vendored(), "xterm.js is not vendored: run `make web`"
    return CHROMIUM


@dataclass
class Site:
    orch: FakeOrchestrator
    links: TerminalLinks
    api_url: str
    proxy_url: str

    def link(self, sandbox_id: str, ttl_s: int = 600) -> str:
        token, _ = self.links.token(sandbox_id, ttl_s)
        return f"{self.proxy_url}/terminal/{sandbox_id}?token={token}"


@pytest.fixture
def site(orch: FakeOrchestrator, tmp_path: Path) -> Iterator[Site]:  # noqa: F811
    links = TerminalLinks.load_or_create(tmp_path)
    keys = ApiKeys([API_KEY])
    with ServerThread(build_proxy_app(orch, DOMAIN, terminal_links=links, keys=keys),
                      lifespan="on") as proxy:
        api_app = build_api_app(orch, keys, domain=DOMAIN, terminal_links=links,
                                terminal_base_url=proxy.url)
        with ServerThread(api_app) as api:
            yield Site(orch, links, api.url, proxy.url)


@pytest.fixture
def browser() -> Iterator[object]:
    """Chromium, per test: Playwright's sync API runs an event loop in this thread while it
    is open, and every asyncio.run() / async test after it in the session would fail."""
    from playwright.sync_api import sync_playwright

    path = require_browser()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()
