"""The real e2b Python SDK talking to a REAL envd through our proxy (E2B_SANDBOX_URL mode:
routing by E2b-Sandbox-Id/Port headers), with sandbox lookup by the in-memory orchestrator
double (HTTP-mapping test; becomes end-to-end with the VM orchestrator)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from host.orchestrator.states import SandboxState
from tests.api.conftest import API_KEY


@pytest.fixture
def sdk_env(servers, monkeypatch):
    api, proxy = servers
    monkeypatch.setenv("E2B_API_URL", api.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", proxy.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_DOMAIN", "sbx.test")
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return servers


def test_commands_stream_through_proxy(sdk_env, orch) -> None:
    sid = orch.add(token=None).sandbox_id
    sbx = Sandbox.connect(sid)
    assert sbx.is_running()
    arrivals: list[tuple[float, str]] = []
    result = sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.4; done",
                              on_stdout=lambda s: arrivals.append((time.monotonic(), s)))
    assert result.exit_code == 0 and result.stdout.split() == ["line1", "line2", "line3"]
    # streamed: the first line arrived well before the last one (not buffered to the end)
    assert arrivals[-1][0] - arrivals[0][0] > 0.5
    calls = [c for c in orch.calls if c[0] == "route"]
    assert calls and all(c[1][0] == sid and c[1][1] == 49983 for c in calls)


def test_files_through_proxy(sdk_env, orch) -> None:
    sbx = Sandbox.connect(orch.add(token=None).sandbox_id)
    path = f"/tmp/aenv-proxy-test-{uuid.uuid4().hex}.bin"   # writable by envd's user
    payload = bytes(range(256)) * 4096 * 8   # 8 MiB
    try:
        sbx.files.write(path, payload)
        assert sbx.files.read(path, format="bytes") == payload
    finally:
        Path(path).unlink(missing_ok=True)


def test_killed_sandbox_is_not_running(sdk_env, orch) -> None:
    sid = orch.add(token=None).sandbox_id
    sbx = Sandbox.connect(sid)
    orch.sandboxes[sid] = dataclasses.replace(orch.sandboxes[sid], state=SandboxState.KILLED)
    assert sbx.is_running() is False            # 502 "was not found"
    with pytest.raises(SandboxException):
        sbx.commands.run("true")
