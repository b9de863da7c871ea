"""What a sandbox's server sees of a request through the proxy (host/proxy/forwarding.py):
never our API key nor the traffic token, envd's token only on envd's and the code
interpreter's ports, the user's own Authorization and cookies always, X-Forwarded-For
the proxy's peer whatever the client claimed. A REAL echo server on loopback stands for
every port of the sandbox (the in-memory orchestrator double routes them all to it).

The proxy is served by uvicorn as `python -m host` serves it, which believes forwarding
headers from loopback peers only (its default `forwarded_allow_ips`): the client that
claims to be someone else connects from 127.0.0.2, an address of the loopback interface
that is not trusted."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import websockets
from starlette.types import Receive, Scope, Send

from host.proxy import build_proxy_app
from tests.api.conftest import ServerThread
from tests.api.double import FakeOrchestrator

from .conftest import DOMAIN

ENVD, CODE_INTERPRETER, USER = 49983, 49999, 8000
CLIENT = "127.0.0.2"     # an untrusted peer (see above)
OURS = {"x-api-key": "e2b_the_api_key", "e2b-traffic-access-token": "traffic-tok",
        "x-access-token": "envd-tok"}
USERS = {"authorization": "Bearer the-users-own", "cookie": "session=abc"}
FORGED = {"x-forwarded-for": "203.0.113.9", "x-forwarded-host": "evil.example",
          "x-forwarded-proto": "https", "forwarded": "for=203.0.113.9", "x-real-ip": "1.2.3.4"}


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers every request (HTTP or WebSocket) with the headers it got, as pairs."""
    if scope["type"] == "lifespan":
        return
    seen = json.dumps([[k.decode("latin-1"), v.decode("latin-1")]
                       for k, v in scope["headers"]])
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": seen})
        await send({"type": "websocket.close"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": seen.encode()})


@pytest.fixture(scope="module")
def echo_port() -> Iterator[int]:
    with ServerThread(echo) as srv:
        yield srv.port


@pytest.fixture
def setup(echo_port: int) -> Iterator[tuple[str, FakeOrchestrator]]:
    orch = FakeOrchestrator(domain=DOMAIN)
    orch.upstream = ("127.0.0.1", echo_port)                 # envd's port
    orch.port_map = {CODE_INTERPRETER: echo_port, USER: echo_port}
    try:
        with ServerThread(build_proxy_app(orch, DOMAIN), lifespan="on") as proxy:
            yield proxy.url, orch
    finally:
        orch.close()


def _seen(pairs: list[list[str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in pairs:
        out.setdefault(k, []).append(v)
    return out


async def _through(proxy_url: str, sid: str, port: int, *, by_host: bool) -> dict[str, list[str]]:
    route = ({"Host": f"{port}-{sid}.{DOMAIN}"} if by_host else
             {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)})
    transport = httpx.AsyncHTTPTransport(local_address=CLIENT)
    async with httpx.AsyncClient(base_url=proxy_url, transport=transport) as c:
        resp = await c.post("/echo", content=b"x",
                            headers={**route, **OURS, **USERS, **FORGED})
    assert resp.status_code == 200, resp.text
    return _seen(resp.json())


@pytest.mark.parametrize("by_host", [True, False], ids=["by-host", "by-headers"])
@pytest.mark.parametrize("port,token_passes", [(USER, False), (ENVD, True),
                                               (CODE_INTERPRETER, True)])
async def test_what_a_sandbox_port_sees(setup, port: int, token_passes: bool,
                                        by_host: bool) -> None:
    proxy_url, orch = setup
    sid = orch.add(traffic_token="traffic-tok").sandbox_id   # checked on 8000 and 49999
    seen = await _through(proxy_url, sid, port, by_host=by_host)
    assert "x-api-key" not in seen
    assert "e2b-traffic-access-token" not in seen
    if token_passes:   # envd checks it; the code interpreter sends it on to envd's /envs
        assert seen["x-access-token"] == ["envd-tok"]
    else:
        assert "x-access-token" not in seen
    assert seen["authorization"] == ["Bearer the-users-own"]
    assert seen["cookie"] == ["session=abc"]
    # the forwarding headers are the proxy's: the peer, nothing the client claimed
    assert seen["x-forwarded-for"] == [CLIENT]
    assert seen["x-forwarded-proto"] == ["http"]
    for name in ("x-forwarded-host", "forwarded", "x-real-ip"):
        assert name not in seen, name


async def test_a_trusted_peer_forwards_for_its_client(setup) -> None:
    """A peer uvicorn trusts (loopback by default: a TLS terminator on the host) is
    believed; the guest then gets that client alone, not the chain."""
    proxy_url, orch = setup
    sid = orch.add().sandbox_id
    async with httpx.AsyncClient(base_url=proxy_url) as c:   # from 127.0.0.1
        resp = await c.get("/", headers={"Host": f"{USER}-{sid}.{DOMAIN}",
                                         "X-Forwarded-For": "198.51.100.7",
                                         "X-Forwarded-Proto": "https"})
    seen = _seen(resp.json())
    assert seen["x-forwarded-for"] == ["198.51.100.7"]
    assert seen["x-forwarded-proto"] == ["https"]


async def test_traffic_token_is_still_checked(setup) -> None:
    proxy_url, orch = setup
    sid = orch.add(traffic_token="traffic-tok").sandbox_id
    async with httpx.AsyncClient(base_url=proxy_url) as c:
        resp = await c.get("/", headers={"Host": f"{USER}-{sid}.{DOMAIN}"})
        assert resp.status_code == 403
        resp = await c.get("/", headers={"Host": f"{USER}-{sid}.{DOMAIN}",
                                         "e2b-traffic-access-token": "wrong"})
        assert resp.status_code == 403


async def test_masked_host_goes_on_as_the_only_forwarded_host(setup) -> None:
    from host.contract import NetworkConfig

    proxy_url, orch = setup
    sid = orch.add(network=NetworkConfig(mask_request_host="app.internal:${PORT}")).sandbox_id
    seen = await _through(proxy_url, sid, USER, by_host=True)
    assert seen["host"] == [f"app.internal:{USER}"]
    assert seen["x-forwarded-host"] == [f"{USER}-{sid}.{DOMAIN}"]   # ours, not the forged one
    assert seen["x-forwarded-for"] == [CLIENT]


@pytest.mark.parametrize("port,token_passes", [(USER, False), (ENVD, True)])
async def test_what_a_websocket_server_sees(setup, port: int, token_passes: bool) -> None:
    proxy_url, orch = setup
    sid = orch.add().sandbox_id
    uri = proxy_url.replace("http://", "ws://") + "/ws"
    async with websockets.connect(uri, local_addr=(CLIENT, 0), additional_headers={
            "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port),
            **OURS, **USERS, **FORGED}) as ws:
        seen = _seen(json.loads(await ws.recv()))
    assert "x-api-key" not in seen and "e2b-traffic-access-token" not in seen
    assert ("x-access-token" in seen) is token_passes
    assert seen["authorization"] == ["Bearer the-users-own"]
    assert seen["x-forwarded-for"] == [CLIENT]
    assert seen["x-forwarded-proto"] == ["http"]
    assert "forwarded" not in seen and "x-real-ip" not in seen
