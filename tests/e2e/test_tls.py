"""The service with --tls: a second, short-lived service (own state dir, namespace pool
10.216.16.0/20) serving the API and the proxy over HTTPS with the generated local CA; the
SDKs trust it via SSL_CERT_FILE (the Python SDK's Rust client reads it when its first
client is built, so a fresh interpreter) and NODE_EXTRA_CA_CERTS.

Two ways in:
* pure E2B_DOMAIN mode (what a deployment uses): only E2B_DOMAIN, E2B_API_KEY and the CA
  variables are set, so the SDKs themselves build https://api.sbx.localhost and
  https://<port>-<id>.sbx.localhost on port 443. They run inside a private network
  namespace (tests/e2e/domain_net.py) where `*.localhost` resolves to loopback and :443
  is relayed byte for byte to the service's proxy port, which serves `api.<domain>` too;
* E2B_API_URL / E2B_SANDBOX_URL pointing at https://localhost:<port> (the certificate also
  names localhost and 127.0.0.1), run directly on the host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.orchestrator.hostproc import REPO

from .conftest import TLS_POOL, E2EService, private_service
from .domain_net import DomainNet

pytestmark = [pytest.mark.vm, pytest.mark.slow]

DOMAIN = "sbx.localhost"


@pytest.fixture(scope="module")
def tls_service() -> Iterator[E2EService]:
    with private_service("ae2et", prefix="ae2et-", pool=TLS_POOL,
                         extra=["--tls", "--domain", DOMAIN]) as s:
        yield s


@pytest.fixture(scope="module")
def domain_net(tls_service: E2EService) -> Iterator[DomainNet]:
    nss = [*Path("/usr/lib").glob("*/libnss_myhostname.so.2"),
           *Path("/lib").glob("*/libnss_myhostname.so.2")]
    if shutil.which("ip") is None or not nss:
        pytest.skip("needs iproute2 and libnss-myhostname (make setup)")
    net = DomainNet(f"ae2etls-{os.getpid()}", tls_service.proxy_port)
    try:
        net.open()
        yield net
    finally:
        net.close()


def _domain_env(s: E2EService) -> dict[str, str]:
    """Pure E2B_DOMAIN mode: no E2B_API_URL / E2B_SANDBOX_URL (nor any other E2B_*)."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TERM") if k in os.environ}
    env.update({"E2B_DOMAIN": DOMAIN, "E2B_API_KEY": s.api_key,
                "SSL_CERT_FILE": str(s.ca_cert), "NODE_EXTRA_CA_CERTS": str(s.ca_cert)})
    return env


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


# ---- pure E2B_DOMAIN mode ------------------------------------------------------------------

PY_DOMAIN = """
import json, os, ssl, time, urllib.request
from e2b import CommandExitException, Sandbox
assert not any(k.startswith("E2B_") for k in os.environ
               if k not in ("E2B_DOMAIN", "E2B_API_KEY")), sorted(os.environ)
sbx = Sandbox.create(timeout=120)
out = {"api_url": sbx.connection_config.api_url, "envd_api_url": sbx.envd_api_url,
       "id": sbx.sandbox_id, "host": sbx.get_host(8000)}
out["cmd"] = sbx.commands.run("echo over-https").stdout
sbx.files.write("/home/user/www/index.html", "hello over https")
out["file"] = sbx.files.read("/home/user/www/index.html")
server = sbx.commands.run("python3 -m http.server 8000", background=True, timeout=0,
                          cwd="/home/user/www")
ctx = ssl.create_default_context()  # OpenSSL's default store: SSL_CERT_FILE
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(f"https://{out['host']}/index.html", context=ctx,
                                    timeout=30) as r:
            out["http"] = [r.status, r.read().decode()]
        break
    except Exception as exc:
        if time.monotonic() > deadline:
            raise
        if not ("502" in str(exc) or "Connection" in type(exc).__name__):
            raise
        time.sleep(0.5)
out["server_killed"] = server.kill()
try:  # its stream ends once the process is gone
    server.wait()
except CommandExitException as exc:
    out["server_exit"] = exc.exit_code
out["killed"] = sbx.kill()
out["again"] = Sandbox.kill(sbx.sandbox_id)
print(json.dumps(out))
"""


def test_python_sdk_pure_domain_mode(tls_service: E2EService, domain_net: DomainNet) -> None:
    before = domain_net.connections
    r = subprocess.run(domain_net.exec_argv(sys.executable, "-c", PY_DOMAIN),
                       env=_domain_env(tls_service), capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    sid = out["id"]
    assert out["api_url"] == f"https://api.{DOMAIN}"
    assert out["envd_api_url"] == f"https://49983-{sid}.{DOMAIN}"
    assert out["host"] == f"8000-{sid}.{DOMAIN}"
    assert out["cmd"] == "over-https\n"
    assert out["file"] == "hello over https"
    assert out["http"] == [200, "hello over https"]
    assert (out["server_killed"], out["server_exit"]) == (True, -1)
    assert (out["killed"], out["again"]) == (True, False)
    assert domain_net.connections > before  # it went through :443 in the namespace


JS_DOMAIN = """
import { Sandbox } from 'e2b'
const extra = Object.keys(process.env).filter(
  (k) => k.startsWith('E2B_') && k !== 'E2B_DOMAIN' && k !== 'E2B_API_KEY')
if (extra.length) throw new Error('unexpected ' + extra)
const sbx = await Sandbox.create({ timeoutMs: 120_000 })
const out = { id: sbx.sandboxId, apiUrl: sbx.connectionConfig.apiUrl,
              envdApiUrl: sbx.envdApiUrl, host: sbx.getHost(8000) }
out.cmd = (await sbx.commands.run('echo over-https')).stdout
await sbx.files.write('/home/user/www/index.html', 'hello over https')
out.file = await sbx.files.read('/home/user/www/index.html')
const server = await sbx.commands.run('python3 -m http.server 8000', {
  background: true, timeoutMs: 0, cwd: '/home/user/www' })
const deadline = Date.now() + 60_000
for (;;) {
  let res
  try {
    res = await fetch(`https://${out.host}/index.html`, { signal: AbortSignal.timeout(30_000) })
  } catch (e) {
    if (Date.now() > deadline) throw e
  }
  const body = res && await res.text()  // read it: an unread body pins its connection
  if (res && res.status !== 502) {
    out.http = [res.status, body]
    break
  }
  if (Date.now() > deadline) throw new Error('user port never answered')
  await new Promise((r) => setTimeout(r, 500))
}
out.serverKilled = await server.kill()
// its stream ends with the process (exit code -1), before the sandbox is killed
try { await server.wait() } catch (e) { out.serverExit = e.exitCode }
out.killed = await sbx.kill()
out.again = await Sandbox.kill(sbx.sandboxId)
console.log(JSON.stringify(out))
"""


@pytest.mark.js
def test_js_sdk_pure_domain_mode(tls_service: E2EService, domain_net: DomainNet) -> None:
    js = REPO / "tests" / "js"
    if shutil.which("node") is None or not (js / "node_modules" / "e2b").exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    before = domain_net.connections
    r = subprocess.run(domain_net.exec_argv("node", "--input-type=module", "-e", JS_DOMAIN),
                       env=_domain_env(tls_service), cwd=js, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    sid = out["id"]
    assert out["apiUrl"] == f"https://api.{DOMAIN}"
    assert out["envdApiUrl"] == f"https://49983-{sid}.{DOMAIN}"
    assert out["host"] == f"8000-{sid}.{DOMAIN}"
    assert out["cmd"] == "over-https\n"
    assert out["file"] == "hello over https"
    assert out["http"] == [200, "hello over https"]
    assert (out["serverKilled"], out["serverExit"]) == (True, -1)
    assert (out["killed"], out["again"]) == (True, False)
    assert domain_net.connections > before
