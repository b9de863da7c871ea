"""The service with --tls: a second, short-lived service (own state dir, namespace pool
10.216.16.0/20) serving the API and the proxy over HTTPS with the generated local CA; the
SDKs trust it via SSL_CERT_FILE (the Python SDK's Rust client reads it when its first
client is built, so a fresh interpreter) and NODE_EXTRA_CA_CERTS. E2B_DOMAIN is set; the
URLs point at localhost (the certificate names localhost and 127.0.0.1) since nothing
resolves *.sbx.localhost on this host and the proxy is not on :443."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.orchestrator.hostproc import REPO

from .conftest import TLS_POOL, E2EService, build_template, need_vm

pytestmark = [pytest.mark.vm, pytest.mark.slow]

DOMAIN = "sbx.localhost"


@pytest.fixture(scope="module")
def tls_service() -> Iterator[E2EService]:
    need_vm()
    root = Path(tempfile.mkdtemp(prefix="aenv-e2e-tls-", dir="/var/tmp"))
    s = E2EService(root, prefix="ae2et-", pool=TLS_POOL, tag="ae2et",
                   extra=["--tls", "--domain", DOMAIN])
    try:
        s.start()
        build_template(s)
        yield s
    finally:
        s.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def _env(s: E2EService) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"E2B_API_URL": f"https://localhost:{s.api_port}",
                "E2B_SANDBOX_URL": f"https://localhost:{s.proxy_port}",
                "E2B_API_KEY": s.api_key, "E2B_DOMAIN": DOMAIN,
                "SSL_CERT_FILE": str(s.ca_cert), "NODE_EXTRA_CA_CERTS": str(s.ca_cert)})
    return env


def test_https_api_verifies_only_with_the_ca(tls_service: E2EService) -> None:
    r = httpx.get(f"https://localhost:{tls_service.api_port}/health",
                  verify=str(tls_service.ca_cert), timeout=30)
    assert r.status_code == 200
    with pytest.raises(httpx.ConnectError):  # not trusted without the CA
        httpx.get(f"https://localhost:{tls_service.api_port}/health", timeout=30)


PY = """
from e2b import Sandbox
sbx = Sandbox.create(timeout=120)
assert sbx.get_host(8000) == f"8000-{sbx.sandbox_id}.sbx.localhost"
assert sbx.envd_api_url.startswith("https://"), sbx.envd_api_url
print(sbx.commands.run("echo over-https").stdout.strip())
sbx.files.write("/tmp/t.txt", "tls-file")
print(sbx.files.read("/tmp/t.txt"))
print(sbx.kill())
print(Sandbox.kill(sbx.sandbox_id))
"""


def test_python_sdk_over_https(tls_service: E2EService) -> None:
    r = subprocess.run([sys.executable, "-c", PY], env=_env(tls_service), capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["over-https", "tls-file", "True", "False"]


JS = """
import { Sandbox } from 'e2b'
const sbx = await Sandbox.create({ timeoutMs: 120_000 })
const r = await sbx.commands.run('echo over-https')
const killed = await sbx.kill()
console.log(JSON.stringify({ out: r.stdout, killed, again: await Sandbox.kill(sbx.sandboxId) }))
"""


@pytest.mark.js
def test_js_sdk_over_https(tls_service: E2EService) -> None:
    js = REPO / "tests" / "js"
    if shutil.which("node") is None or not (js / "node_modules" / "e2b").exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    r = subprocess.run(["node", "--input-type=module", "-e", JS], env=_env(tls_service),
                       cwd=js, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"out": "over-https\n", "killed": True, "again": False}
