"""Fixtures for the CLI tests.

What is real and what is not: the REST API (`build_api_app`), the sandbox proxy
(`build_proxy_app`) and envd (`python -m envd`, a real process) are the real code, served
by uvicorn on loopback ports. The sandbox LIFECYCLE is the in-memory orchestrator test
double of tests/api/double.py: no VM runs, and its `route()` points every sandbox at the
one real envd process. Everything started here is stopped.

The template commands run against tests/api/template_service.py instead: the REST API over
a real `NodeOrchestrator` whose runtime is the fake (tests/orchestrator/fakes.py), served
over HTTP (`node_service`); the e2b SDK inside `aenv` talks to it as it would to E2B.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from click.testing import CliRunner, Result

from host.api import ApiKeys, build_api_app
from host.cli import cli
from host.proxy import build_proxy_app
from host.web.links import TerminalLinks
from tests.api.conftest import API_KEY, ServerThread
from tests.api.double import FakeOrchestrator
from tests.api.template_service import NodeService, node_service  # noqa: F401 (fixture)

# the same real envd process and orchestrator double as the proxy tests
from tests.proxy.conftest import DOMAIN, envd_port, orch  # noqa: F401 (fixtures)

REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
_ENV = ("AENV_API_URL", "E2B_API_URL", "AENV_API_KEY", "E2B_API_KEY", "E2B_SANDBOX_URL",
        "AENV_STATE_DIR", "E2B_DOMAIN", "_AENV_COMPLETE", "COMP_WORDS", "COMP_CWORD",
        "NO_COLOR", "FORCE_COLOR")
# the test API's web terminal links (POST /sandboxes/{id}/terminal) and where they point
TERMINAL_LINKS = TerminalLinks(b"t" * 32)
TERMINAL_BASE_URL = "http://terminal.test:3001"


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No ambient AENV_*/E2B_* settings, no readable service key file, and a config dir of
    the test's own (empty: no saved credentials; never the user's ~/.config)."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AENV_STATE_DIR", str(tmp_path_factory.mktemp("no-state")))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))


@dataclass
class Stack:
    orch: FakeOrchestrator
    api_url: str
    sandbox_url: str

    def argv(self, *args: str, key: str | None = API_KEY) -> list[str]:
        out = ["--api-url", self.api_url, "--sandbox-url", self.sandbox_url]
        if key is not None:
            out += ["--api-key", key]
        return out + list(args)

    def env(self, key: str = API_KEY) -> dict[str, str]:
        return {"AENV_API_URL": self.api_url, "E2B_SANDBOX_URL": self.sandbox_url,
                "AENV_API_KEY": key}

    def run(self, *args: str, key: str | None = API_KEY, stdin: str | None = None) -> Result:
        return CliRunner().invoke(cli, self.argv(*args, key=key), input=stdin,
                                  catch_exceptions=False)


def invoke(*args: str, stdin: str | None = None) -> Result:
    """`aenv ARGS` in-process with no global options (settings from env and files)."""
    return CliRunner().invoke(cli, list(args), input=stdin, catch_exceptions=False)


@pytest.fixture
def stack(orch: FakeOrchestrator) -> Iterator[Stack]:  # noqa: F811 - the imported fixture
    api_app = build_api_app(orch, ApiKeys([API_KEY]), domain=DOMAIN,
                            terminal_links=TERMINAL_LINKS, terminal_base_url=TERMINAL_BASE_URL)
    proxy_app = build_proxy_app(orch, DOMAIN, api_app=api_app)
    with ServerThread(api_app) as api, ServerThread(proxy_app, lifespan="on") as proxy:
        yield Stack(orch, api.url, proxy.url)


@dataclass
class TemplateStack:
    """`aenv` against the template service (`svc`: its fake runtime, store and files)."""

    svc: NodeService

    def argv(self, *args: str, key: str | None = API_KEY) -> list[str]:
        out = ["--api-url", self.svc.url]
        if key is not None:
            out += ["--api-key", key]
        return out + list(args)

    def run(self, *args: str, key: str | None = API_KEY, stdin: str | None = None) -> Result:
        return CliRunner().invoke(cli, self.argv(*args, key=key), input=stdin,
                                  catch_exceptions=False)


@pytest.fixture
def tstack(node_service: NodeService) -> TemplateStack:  # noqa: F811 - the imported fixture
    return TemplateStack(node_service)
