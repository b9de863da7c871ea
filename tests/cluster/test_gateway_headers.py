"""Sandbox traffic through the gateway (host/cluster/gateway/forward.py): the client's API
key stops at the gateway; the traffic token and envd's token go on to the node's proxy,
which checks the one and drops both before a user port (host/proxy/forwarding.py); the
forwarding headers are set at each hop, never the client's.

Two views: the gateway -> node hop alone (`NodeClient.relay` into an echo server standing
for a node's proxy), and the whole way into a sandbox port of a real cluster (harness.py),
whose nodes' runtimes forward port HEADERS_PORT to a header echo server of this module.

Clients that forge forwarding headers connect from 127.0.0.2: uvicorn (the gateway and the
nodes are served with its defaults, as their __main__ serve them) believes such headers
from loopback peers only, and 127.0.0.2 is a loopback address it does not trust. The
nodes do trust the gateway (127.0.0.1), as a node told so with FORWARDED_ALLOW_IPS would:
the sandbox then sees the client's own address."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from host.cluster.gateway.forward import NodeClient
from tests.api.conftest import API_KEY, ServerThread

from .harness import DOMAIN, Cluster

HEADERS_PORT = 9000
CLIENT = "127.0.0.2"
FORGED = {"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Host": "evil.example",
          "Forwarded": "for=203.0.113.9", "X-Real-IP": "203.0.113.9"}
USERS = {"Authorization": "Bearer the-users-own", "Cookie": "session=abc"}


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with the request's headers, as [name, value] pairs."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(
        [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]]).encode()})


def seen(resp: httpx.Response) -> dict[str, list[str]]:
    assert resp.status_code == 200, resp.text
    out: dict[str, list[str]] = {}
    for k, v in resp.json():
        out.setdefault(k, []).append(v)
    return out


@pytest.fixture(scope="module")
def echo_server() -> Iterator[ServerThread]:
    with ServerThread(echo) as srv:
        yield srv


def test_the_gateway_hop_keeps_what_the_node_checks(echo_server: ServerThread) -> None:
    """What a node's proxy gets from the gateway: the tokens it needs (traffic token to
    check, envd's token for envd), not the client's API key; X-Forwarded-For the client."""
    clients: list[NodeClient] = []

    async def gateway(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":   # the client's pool lives on the server's loop
            await receive()
            clients.append(NodeClient("node-key"))
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await clients[0].aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        await clients[0].relay(echo_server.url, scope, receive, send, sandbox_id="x")

    with ServerThread(gateway, lifespan="on") as gw:
        transport = httpx.HTTPTransport(local_address=CLIENT)
        with httpx.Client(base_url=gw.url, transport=transport, timeout=30) as c:
            got = seen(c.get("/", headers={
                "X-API-Key": API_KEY, "e2b-traffic-access-token": "traffic-tok",
                "X-Access-Token": "envd-tok", **USERS, **FORGED}))
    assert "x-api-key" not in got
    assert got["e2b-traffic-access-token"] == ["traffic-tok"]
    assert got["x-access-token"] == ["envd-tok"]
    assert got["authorization"] == ["Bearer the-users-own"]
    assert got["x-forwarded-for"] == [CLIENT]
    assert got["x-forwarded-proto"] == ["http"]
    for name in ("x-forwarded-host", "forwarded", "x-real-ip"):
        assert name not in got, name


@pytest.fixture
def cluster(make_cluster, echo_server: ServerThread) -> Cluster:
    made = make_cluster(nodes=1)
    for node in made.nodes:   # every sandbox's HEADERS_PORT: this module's echo server
        assert node.orch is not None
        node.orch.runtime.ports[str(HEADERS_PORT)] = echo_server.port  # type: ignore[attr-defined]
    return made


def test_the_whole_way_into_a_sandbox_port(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.url, headers={"X-API-Key": API_KEY}, timeout=30) as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "secure": True,
                                          "network": {"allowPublicTraffic": False}})
        assert r.status_code == 201, r.text
        box = r.json()
    sid, traffic = box["sandboxID"], box["trafficAccessToken"]
    assert traffic
    transport = httpx.HTTPTransport(local_address=CLIENT)
    with httpx.Client(base_url=cluster.url, transport=transport, timeout=30) as c:
        for route in ({"Host": f"{HEADERS_PORT}-{sid}.{DOMAIN}"},
                      {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(HEADERS_PORT)}):
            # the node's proxy checks the traffic token the gateway passed on
            r = c.get("/", headers=route)
            assert r.status_code == 403 and "e2b-traffic-access-token" in r.text
            got = seen(c.get("/", headers={
                **route, "X-API-Key": API_KEY, "e2b-traffic-access-token": traffic,
                "X-Access-Token": box["envdAccessToken"], **USERS, **FORGED}))
            for name in ("x-api-key", "e2b-traffic-access-token", "x-access-token",
                         "x-forwarded-host", "forwarded", "x-real-ip"):
                assert name not in got, name
            assert got["authorization"] == ["Bearer the-users-own"]
            assert got["cookie"] == ["session=abc"]
            assert got["x-forwarded-for"] == [CLIENT]
