"""Signed file URLs (`upload_url` / `download_url`, JS `uploadUrl` / `downloadUrl`) used by
a client that sends no E2b-Sandbox-* header (curl, a browser), in both SDK modes: through
the proxy to a REAL envd holding an access token; sandbox lookup by the orchestrator
double. In E2B_SANDBOX_URL mode the URL names no sandbox: the proxy finds it by the
signature."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from e2b import Sandbox

from tests.api.conftest import API_KEY, free_port

from .conftest import start_process, stop_process

TOKEN = "signed-url-test-token"
REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "tests" / "js" / "node_modules" / "e2b" / "dist" / "index.mjs"


@pytest.fixture(scope="module")
def token_envd_port() -> Iterator[int]:
    """An envd whose access token (set by /init, as the host does) is TOKEN."""
    port = free_port()
    proc = start_process([sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port",
                          str(port), "--default-user", os.environ.get("ENVD_TEST_USER", "user")],
                         health=f"http://127.0.0.1:{port}/health")
    try:
        resp = httpx.post(f"http://127.0.0.1:{port}/init", json={"accessToken": TOKEN})
        assert resp.status_code == 204, resp.text
        yield port
    finally:
        stop_process(proc)


@pytest.fixture
def sandboxes(orch, token_envd_port) -> tuple[str, str]:
    """(the sandbox whose token is TOKEN, another one)."""
    orch.upstream = ("127.0.0.1", token_envd_port)
    other = orch.add(token="another-sandbox-token").sandbox_id
    return orch.add(token=TOKEN).sandbox_id, other


@pytest.fixture
def remote_path() -> Iterator[str]:
    path = f"/tmp/aenv-signed-url-{uuid.uuid4().hex}.txt"   # writable by envd's user
    yield path
    Path(path).unlink(missing_ok=True)


def sdk_env(monkeypatch, api_url: str, sandbox_url: str | None) -> None:
    for var in ("E2B_DEBUG", "E2B_SANDBOX_URL", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("E2B_API_URL", api_url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_DOMAIN", "sbx.test")
    if sandbox_url:
        monkeypatch.setenv("E2B_SANDBOX_URL", sandbox_url)


def plain(proxy_url: str, url: str) -> tuple[str, dict[str, str]]:
    """(URL to send, headers) for a client with nothing but the URL: an URL on the proxy
    goes as is; a `<port>-<id>.<domain>` one goes to the proxy with that Host (what DNS
    and TLS would do)."""
    parts = urlsplit(url)
    if parts.hostname == "127.0.0.1":
        return url, {}
    return f"{proxy_url}{parts.path}?{parts.query}", {"host": parts.netloc}


def upload_and_download(proxy_url: str, up: str, down: str, body: str) -> None:
    url, headers = plain(proxy_url, up)
    resp = httpx.post(url, headers=headers, files={"file": ("f.txt", body.encode())})
    assert resp.status_code == 200, resp.text
    url, headers = plain(proxy_url, down)
    resp = httpx.get(url, headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.text == body


@pytest.mark.parametrize("mode", ["sandbox_url", "domain"])
@pytest.mark.parametrize("expiration", [None, 300])
def test_python_signed_urls_without_headers(servers, orch, sandboxes, remote_path, monkeypatch,
                                            mode: str, expiration: int | None) -> None:
    api, proxy = servers
    sid, _ = sandboxes
    sdk_env(monkeypatch, api.url, proxy.url if mode == "sandbox_url" else None)
    sbx = Sandbox.connect(sid)
    up = sbx.upload_url(remote_path, use_signature_expiration=expiration)
    down = sbx.download_url(remote_path, use_signature_expiration=expiration)
    assert "signature=v1_" in up and sid not in urlsplit(up).query
    orch.calls.clear()
    upload_and_download(proxy.url, up, down, f"signed {mode}")
    routed = {c[1][0] for c in orch.calls if c[0] == "route"}
    assert routed == {sid}


def test_signature_must_match_a_sandbox(servers, sandboxes, remote_path, monkeypatch) -> None:
    api, proxy = servers
    sid, _ = sandboxes
    sdk_env(monkeypatch, api.url, proxy.url)
    up = Sandbox.connect(sid).upload_url(remote_path)
    # a signature for another path, user or operation names no sandbox: not routed
    for bad in (up.replace("aenv-signed-url", "aenv-other"), up + "&username=root"):
        resp = httpx.post(bad, files={"file": ("f.txt", b"x")})
        assert resp.status_code == 400 and "E2b-Sandbox-Id" in resp.json()["message"]
    assert httpx.get(up).status_code == 400      # signed for "write", used to read
    assert not Path(remote_path).exists()
    # an expired signature still names its sandbox, and envd refuses it
    expired = Sandbox.connect(sid).download_url(remote_path, use_signature_expiration=-10)
    resp = httpx.get(expired)
    assert resp.status_code == 401 and "expired" in resp.text


@pytest.mark.js
@pytest.mark.parametrize("mode", ["sandbox_url", "domain"])
def test_js_signed_urls_without_headers(servers, sandboxes, remote_path, mode: str) -> None:
    if shutil.which("node") is None or not SDK.exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    api, proxy = servers
    sid, _ = sandboxes
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"E2B_API_URL": api.url, "E2B_API_KEY": API_KEY, "E2B_DOMAIN": "sbx.test"})
    if mode == "sandbox_url":
        env["E2B_SANDBOX_URL"] = proxy.url
    script = ("const { Sandbox } = await import(process.argv[1]);"
              "const s = await Sandbox.connect(process.argv[2]);"
              "console.log(JSON.stringify([await s.uploadUrl(process.argv[3]),"
              " await s.downloadUrl(process.argv[3], { useSignatureExpiration: 300 })]));")
    res = subprocess.run(["node", "--input-type=module", "-e", script, SDK.as_uri(), sid,
                          remote_path], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    up, down = json.loads(res.stdout.strip().splitlines()[-1])
    upload_and_download(proxy.url, up, down, f"signed by js {mode}")
