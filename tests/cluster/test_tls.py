"""TLS inside a cluster, with real TLS servers on loopback and certificates from
host/proxy/tls.py's local CA: nodes serving their API and proxy over HTTPS, the gateway
verifying them with --node-tls-ca (API calls, HTTP and WebSocket traffic), a gateway that
does not trust that CA reaching none of them; and Redis with a password, and over TLS
(`rediss://`), as deploy/ runs it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import websockets

from host.api import ApiKeys, NodeKeys
from host.cluster.config import GatewayConfig, SchedulerConfig
from host.cluster.errors import StoreUnavailable
from host.cluster.gateway import build_gateway
from host.cluster.scheduler import build_scheduler_app
from host.cluster.store import ClusterStore
from host.proxy.tls import CertPaths, ensure_certificates
from tests.api.conftest import API_KEY

from .harness import DOMAIN, NODE_KEY, USER_PORT, Cluster, RedisServer, Served
from .test_gateway import api, create


@pytest.fixture
def certs(tmp_path: Path) -> CertPaths:
    """A leaf for 127.0.0.1 (and *.sbx.test) signed by a fresh local CA."""
    return ensure_certificates(tmp_path / "tls", DOMAIN)


def placed_on(cluster: Cluster, ca: Path) -> dict[str, str]:
    """sandbox id -> node id, from each node's own API over HTTPS."""
    out = {}
    for node in cluster.nodes:
        r = httpx.get(f"{node.url}/v2/sandboxes", headers={"X-API-Key": API_KEY},
                      verify=str(ca))
        out.update({s["sandboxID"]: node.node_id for s in r.json()})
    return out


def test_gateway_verifies_https_nodes_with_the_given_ca(make_cluster, certs: CertPaths) -> None:
    cluster: Cluster = make_cluster(nodes=2, tls=certs)
    with pytest.raises(httpx.TransportError):   # the nodes speak HTTPS only
        httpx.get(f"http://127.0.0.1:{cluster.nodes[0].api_port}/health", timeout=5)
    with api(cluster) as c:
        nodes = c.get("/nodes").json()
        assert sorted(n["address"] for n in nodes) == sorted(n.url for n in cluster.nodes)
        assert all(n["address"].startswith("https://") for n in nodes)
        sids = [create(c)["sandboxID"] for _ in range(2)]
        assert c.get(f"/sandboxes/{sids[0]}").json()["state"] == "running"
        assert c.post(f"/sandboxes/{sids[1]}/pause").status_code == 204
        assert c.post(f"/sandboxes/{sids[1]}/connect", json={"timeout": 60}).status_code in (
            200, 201)
    placed = placed_on(cluster, certs.ca_cert)
    assert sorted(placed[s] for s in sids) == ["node1", "node2"]
    for sid in sids:   # traffic through the gateway to the nodes' HTTPS proxies
        r = httpx.post(f"{cluster.url}/echo", content=b"over tls",
                       headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(USER_PORT)})
        assert r.status_code == 200 and r.json()["node"] == placed[sid], r.text

        async def ws(sid: str = sid) -> str:
            uri = f"ws://127.0.0.1:{cluster.gateway_port}/ws"
            async with websockets.connect(uri, additional_headers={
                    "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(USER_PORT)}) as conn:
                await conn.send("ping")
                return str(await conn.recv())

        assert asyncio.run(ws()) == f"{placed[sid]}:ping"


def test_gateway_refuses_nodes_it_cannot_verify(make_cluster, certs: CertPaths) -> None:
    """A gateway without --node-tls-ca verifies with the system's CAs, which never signed
    the local CA's certificates: no call and no traffic reaches a node."""
    cluster: Cluster = make_cluster(nodes=2, tls=certs)
    with api(cluster) as c:
        sid = create(c)["sandboxID"]
    cfg = GatewayConfig(redis=cluster.redis_url,
                        scheduler=f"http://127.0.0.1:{cluster.scheduler_port}")
    with Served(build_gateway(cfg, keys=ApiKeys([API_KEY]), node_keys=NodeKeys([NODE_KEY])),
                lifespan="on") as gw:
        headers = {"X-API-Key": API_KEY}
        r = httpx.get(f"{gw.url}/sandboxes/{sid}", headers=headers)
        assert r.status_code == 502 and "certificate verify failed" in r.json()["message"]
        # each node unreachable is left out of the next placement: none is left (429)
        r = httpx.post(f"{gw.url}/v2/sandboxes", json={"templateID": "base"}, headers=headers)
        assert r.status_code == 429 and "node1" in r.text and "node2" in r.text, r.text
        r = httpx.get(f"{gw.url}/echo", headers={"E2b-Sandbox-Id": sid,
                                                 "E2b-Sandbox-Port": str(USER_PORT)})
        assert r.status_code == 502 and "certificate verify failed" in r.text
    assert list(placed_on(cluster, certs.ca_cert)) == [sid]   # the refused create made none


def test_bad_node_tls_ca_fails_the_start(tmp_path: Path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="node TLS CA"):
        build_gateway(GatewayConfig(node_tls_ca=bad), keys=ApiKeys([API_KEY]),
                      node_keys=NodeKeys([NODE_KEY]))


# --- Redis: a password, and TLS --------------------------------------------------------


def _ping(url: str) -> bool:
    async def go() -> bool:
        store = ClusterStore.from_url(url, timeout_s=3)
        try:
            return await store.ping()
        finally:
            await store.aclose()
    return asyncio.run(go())


def test_redis_password_in_the_url() -> None:
    server = RedisServer(password="s3cret-pw")
    try:
        assert _ping(server.url)
        plain = f"redis://127.0.0.1:{server.port}/0"
        for url in (plain, f"redis://:wrong@127.0.0.1:{server.port}/0"):
            with pytest.raises(StoreUnavailable) as exc:
                _ping(url)
            assert "s3cret" not in str(exc.value)
        # a scheduler given the URL with the password serves, one without does not
        for url, status in ((server.url, 200), (plain, 503)):
            with Served(build_scheduler_app(SchedulerConfig(redis=url)), lifespan="on") as s:
                assert httpx.get(f"{s.url}/health").status_code == status
    finally:
        server.stop()


def test_redis_over_tls(certs: CertPaths) -> None:
    """rediss:// with the operator's CA in the URL (`ssl_ca_certs=`), as the deploy README
    shows; the server's certificate is not trusted without it."""
    server = RedisServer(password="pw", tls=certs)
    try:
        assert server.url.startswith("rediss://:pw@")
        assert _ping(server.url)
        with pytest.raises(StoreUnavailable, match="certificate verify failed"):
            _ping(f"rediss://:pw@127.0.0.1:{server.port}/0")
        with pytest.raises(StoreUnavailable):   # TLS only: plain connections fail
            _ping(f"redis://:pw@127.0.0.1:{server.port}/0")
    finally:
        server.stop()
