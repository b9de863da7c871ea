"""TLS mode: the proxy serves a wildcard certificate from a local CA (host/proxy/tls.py);
httpx verifies it for `49983-<id>.<domain>` (SNI + Host routing) and the e2b SDK runs a
command over https through it, trusting the CA via SSL_CERT_FILE."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from host.api import ApiKeys, build_api_app
from host.orchestrator.states import SandboxState
from host.proxy import build_proxy_app
from host.proxy.tls import ensure_certificates
from tests.api.conftest import API_KEY, ServerThread

from .conftest import DOMAIN


@pytest.fixture
def tls_servers(orch, tmp_path):
    paths = ensure_certificates(tmp_path / "tls", DOMAIN)
    api_app = build_api_app(orch, ApiKeys([API_KEY]), domain=DOMAIN)
    proxy_app = build_proxy_app(orch, DOMAIN, api_app=api_app)
    with ServerThread(api_app) as api, ServerThread(
            proxy_app, lifespan="on", ssl_certfile=str(paths.cert),
            ssl_keyfile=str(paths.key)) as proxy:
        yield api, proxy, paths


async def test_wildcard_certificate_and_host_routing(tls_servers, orch) -> None:
    _, proxy, paths = tls_servers
    sid = orch.add(token=None).sandbox_id
    name = f"49983-{sid}.{DOMAIN}"
    ctx = ssl.create_default_context(cafile=str(paths.ca_cert))
    async with httpx.AsyncClient(verify=ctx) as c:
        resp = await c.get(f"https://127.0.0.1:{proxy.port}/health",
                           headers={"Host": name}, extensions={"sni_hostname": name})
        assert resp.status_code == 204
        api = f"api.{DOMAIN}"
        resp = await c.get(f"https://127.0.0.1:{proxy.port}/v2/sandboxes",
                           headers={"Host": api, "X-API-Key": API_KEY},
                           extensions={"sni_hostname": api})
        assert resp.status_code == 200 and resp.json()[0]["sandboxID"] == sid
    # an unrelated name is rejected by verification
    async with httpx.AsyncClient(verify=ctx) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(f"https://127.0.0.1:{proxy.port}/health",
                        extensions={"sni_hostname": "other.example"})


def test_sdk_over_https(tls_servers, orch) -> None:
    """In a fresh interpreter: the SDK's Rust HTTP client reads SSL_CERT_FILE once, when
    its first client is built, so earlier SDK use in this process would hide the CA."""
    api, proxy, paths = tls_servers
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"SSL_CERT_FILE": str(paths.ca_cert), "E2B_API_URL": api.url,
                "E2B_SANDBOX_URL": f"https://localhost:{proxy.port}", "E2B_API_KEY": API_KEY})
    sid = orch.add(token=None).sandbox_id
    code = ("from e2b import Sandbox; import sys; "
            f"print(Sandbox.connect({sid!r}).commands.run('echo over-tls').stdout.strip())")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "over-tls"


@pytest.mark.js
def test_js_sdk_over_https(tls_servers, orch) -> None:
    """undici offers h2 and http/1.1 via ALPN; our listener speaks http/1.1 only."""
    from .test_js_sdk import SDK
    if shutil.which("node") is None or not SDK.exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    api, proxy, paths = tls_servers
    running = orch.add(token=None, metadata={"team name": "x/y&z"})
    paused = orch.add(token=None, metadata={"team name": "x/y&z"}, state=SandboxState.PAUSED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"NODE_EXTRA_CA_CERTS": str(paths.ca_cert), "E2B_API_URL": api.url,
                "E2B_SANDBOX_URL": f"https://localhost:{proxy.port}", "E2B_API_KEY": API_KEY,
                "E2B_JS_SDK": SDK.as_uri()})
    script = Path(__file__).with_name("js_sdk.mjs")
    res = subprocess.run(["node", str(script), running.sandbox_id, paused.sandbox_id], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["run"]["stdout"] == "one\ntwo\n" and out["file"] == "via proxy"
