"""Credentials never reach a guest (host/proxy/forwarding.py), against a real VM: a header
echo server started in the sandbox with `commands.run(background=True)` answers, through
the proxy, with the headers it got. Our API key, the traffic token and envd's token are
not among them (the request carried all three), the user's own Authorization and cookie
are, X-Forwarded-For is the client's address, not what the client claimed; envd itself
still gets its token (the SDK's own calls keep working).

The client connects from 127.0.0.2: the service's uvicorn believes forwarding headers
from 127.0.0.1 only (its default), so this client's forged X-Forwarded-For must not be.
The faster, VM-free versions are tests/proxy/test_forwarding.py and
tests/cluster/test_gateway_headers.py."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import E2EService

pytestmark = [pytest.mark.vm, pytest.mark.slow]

PORT = 8080
CLIENT = "127.0.0.2"
HEADER_ECHO = """\
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps([[k.lower(), v] for k, v in self.headers.items()]).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(('0.0.0.0', int(sys.argv[1])), H).serve_forever()
"""


def _get(client: httpx.Client, url: str, headers: dict[str, str]) -> httpx.Response:
    """GET, retried while the guest's server is not listening yet (502 port not open)."""
    deadline = time.monotonic() + 60
    while True:
        r = client.get(url, headers=headers)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


def test_credentials_never_reach_a_user_port(env: E2EService) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300, secure=True, network={"allow_public_traffic": False})
    try:
        envd_token = sbx._envd_access_token
        traffic = sbx.traffic_access_token
        assert envd_token and traffic
        sbx.files.write("/home/user/header_echo.py", HEADER_ECHO)
        sbx.commands.run(f"python3 /home/user/header_echo.py {PORT}", background=True,
                         timeout=0)
        sent = {"X-API-Key": env.api_key, "X-Access-Token": envd_token,
                "e2b-traffic-access-token": traffic,
                "Authorization": "Bearer the-users-own", "Cookie": "session=abc",
                "X-Forwarded-For": "203.0.113.9", "Forwarded": "for=203.0.113.9"}
        routes = ({"Host": sbx.get_host(PORT)},                       # E2B_DOMAIN form
                  {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(PORT)})
        transport = httpx.HTTPTransport(local_address=CLIENT)
        with httpx.Client(transport=transport, timeout=30) as c:
            for route in routes:
                r = _get(c, f"{env.sandbox_url}/", {**route, **sent})
                assert r.status_code == 200, r.text
                seen: dict[str, list[str]] = {}
                for k, v in r.json():
                    seen.setdefault(k, []).append(v)
                for name in ("x-api-key", "x-access-token", "e2b-traffic-access-token",
                             "forwarded"):
                    assert name not in seen, (name, seen)
                assert env.api_key not in r.text and envd_token not in r.text
                assert traffic not in r.text
                assert seen["authorization"] == ["Bearer the-users-own"]
                assert seen["cookie"] == ["session=abc"]
                assert seen["x-forwarded-for"] == [CLIENT]
                # the traffic token is still what lets a request in
                r = c.get(f"{env.sandbox_url}/", headers=route)
                assert r.status_code == 403, r.text
        # envd gets its token: the SDK's own calls work
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()
