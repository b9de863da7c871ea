"""Issue 14 parity items that the host decides, checked with the Python SDK against real
VMs (each also has a faster test against the API double or a host-run envd):

- 7: `list(started_after=t)` is inclusive at the precision `started_at` is answered with
- 11: signed file URLs work from a client that sends no E2b-Sandbox-* header (mode B:
  E2B_SANDBOX_URL, where the URL's host names no sandbox)
- 23: `maskRequestHost` is the Host the user's server sees; options we do not honour are
  refused with a 400 naming them"""

from __future__ import annotations

import datetime as dt
import time

import httpx
import pytest

from .conftest import E2EService

pytestmark = [pytest.mark.vm, pytest.mark.slow]

HOST_ECHO = """\
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (self.headers.get('Host', '') + '|' +
                self.headers.get('X-Forwarded-Host', '')).encode()
        self.send_response(200); self.send_header('Content-Length', str(len(body)))
        self.end_headers(); self.wfile.write(body)
http.server.ThreadingHTTPServer(('0.0.0.0', int(sys.argv[1])), H).serve_forever()
"""


def test_started_after_is_inclusive(env: E2EService) -> None:
    import asyncio

    from e2b import AsyncSandbox, Sandbox, SandboxQuery

    sbx = Sandbox.create(timeout=300, metadata={"parity": "7"})
    try:
        started = sbx.get_info().started_at

        def ids(t: dt.datetime) -> list[str]:
            q = SandboxQuery(metadata={"parity": "7"}, started_after=t)
            return [s.sandbox_id for s in Sandbox.list(query=q).next_items()]

        async def async_ids(t: dt.datetime) -> list[str]:
            q = SandboxQuery(metadata={"parity": "7"}, started_after=t)
            return [s.sandbox_id for s in await AsyncSandbox.list(query=q).next_items()]

        assert ids(started) == [sbx.sandbox_id]
        assert asyncio.run(async_ids(started)) == [sbx.sandbox_id]
        later = started + dt.timedelta(seconds=1)
        assert ids(later) == [] and asyncio.run(async_ids(later)) == []
    finally:
        sbx.kill()


def test_signed_urls_without_sandbox_headers(env: E2EService) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300, secure=True)
    try:
        sbx.files.write("/home/user/signed.txt", "signed content")
        url = sbx.download_url("/home/user/signed.txt")
        assert url.startswith(env.sandbox_url)         # mode B: the proxy, no sandbox id
        r = httpx.get(url, timeout=60)                  # like curl: no E2b-Sandbox-* header
        assert r.status_code == 200 and r.text == "signed content"
        up = sbx.upload_url("/home/user/uploaded.txt", use_signature_expiration=120)
        r = httpx.post(up, files={"file": ("uploaded.txt", b"from a plain client")},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert sbx.files.read("/home/user/uploaded.txt") == "from a plain client"
        # a signature for another path is not accepted
        forged = url.replace("signed.txt", "other.txt")
        assert httpx.get(forged, timeout=60).status_code in (400, 401, 403)
    finally:
        sbx.kill()


def test_mask_request_host_is_what_the_server_sees(env: E2EService) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300, network={"mask_request_host": "app.internal:${PORT}"})
    try:
        sbx.files.write("/home/user/host_echo.py", HOST_ECHO)
        sbx.commands.run("python3 /home/user/host_echo.py 8080", background=True, timeout=0)
        host = sbx.get_host(8080)
        deadline = time.monotonic() + 60
        while True:
            r = httpx.get(f"{env.sandbox_url}/", headers={"Host": host}, timeout=30)
            if r.status_code != 502 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        seen_host, forwarded = r.text.split("|")
        assert seen_host == "app.internal:8080" and forwarded == host
        # envd's own port is never masked: the SDK keeps working
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()


@pytest.mark.parametrize("network, member", [
    ({"allow_out": ["example.com"]}, "allowOut"),
])
def test_unhonoured_network_options_are_refused(env: E2EService, network: dict,
                                                member: str) -> None:
    from e2b import Sandbox
    from e2b.exceptions import InvalidArgumentException, SandboxException

    with pytest.raises((InvalidArgumentException, SandboxException)) as err:
        Sandbox.create(timeout=60, network=network)
    assert member in str(err.value)
    with env.client() as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "network":
                                          {"egressProxy": {"url": "http://p:3128"}}})
        assert r.status_code == 400 and "egressProxy" in r.json()["message"]


def test_background_command_of_a_killed_sandbox(env: E2EService) -> None:
    """Item 9: the stream ends as on E2B (connection terminated), and the SDK reports
    "killed or reached its end of life" as a TimeoutException (JS: TimeoutError)."""
    from e2b import Sandbox, TimeoutException

    sbx = Sandbox.create(timeout=300)
    handle = sbx.commands.run("sleep 1000", background=True, timeout=0)
    assert Sandbox.kill(sbx.sandbox_id)
    with pytest.raises(TimeoutException, match="killed or reached its end of life"):
        handle.wait()


@pytest.mark.js
def test_background_command_of_a_killed_sandbox_js(env: E2EService) -> None:
    assert _node(env, "killed.mjs")["error"] == "TimeoutError"


def _node(env: E2EService, script: str) -> dict:
    import json
    import os
    import shutil
    import subprocess

    from tests.orchestrator.hostproc import REPO

    js = REPO / "tests" / "js"
    if shutil.which("node") is None or not (js / "node_modules" / "e2b").exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    penv = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    penv.update(env.sdk_env())
    penv["E2B_DOMAIN"] = "sbx.localhost"
    r = subprocess.run(["node", str(js / script)], env=penv, cwd=js, capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_background_command_survives_pause_python(env: E2EService) -> None:
    """Item 10, the Python SDK: the command started before pause() finishes after
    connect()."""
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300)
    try:
        sbx.commands.run("sleep 2 && echo done > /home/user/f", background=True, timeout=0)
        assert sbx.pause()
        again = Sandbox.connect(sbx.sandbox_id, timeout=300)
        time.sleep(4)
        assert again.files.read("/home/user/f") == "done\n"
    finally:
        Sandbox.kill(sbx.sandbox_id)


@pytest.mark.js
def test_background_command_survives_pause_js(env: E2EService) -> None:
    """Item 10, the JS SDK (it did not, with the JS SDK, before)."""
    assert _node(env, "pause_background.mjs")["content"] == "done\n"
