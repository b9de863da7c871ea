"""The gateway over three real nodes (harness.py): creates spread by the scheduler, every
sandbox call forwarded to the node holding the sandbox, listings merged across nodes with
one pagination, GET /nodes, API keys, and sandbox traffic (HTTP, streamed, WebSocket, by
host and by headers) reaching the right node."""

from __future__ import annotations

import asyncio
import collections

import httpx
import websockets

from tests.api.conftest import API_KEY

from .harness import DOMAIN, USER_PORT, Cluster


def api(cluster: Cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, headers={"X-API-Key": API_KEY}, timeout=30)


def create(c: httpx.Client, **body) -> dict:
    r = c.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert r.status_code == 201, r.text
    return r.json()


def where(cluster: Cluster, c: httpx.Client) -> dict[str, str]:
    """sandbox id -> node id, from each running node's own API."""
    out = {}
    for node in cluster.nodes:
        try:
            r = httpx.get(f"{node.url}/v2/sandboxes", headers={"X-API-Key": API_KEY})
        except httpx.ConnectError:
            continue   # a stopped node
        out.update({s["sandboxID"]: node.node_id for s in r.json()})
    return out


def test_creates_spread_over_nodes(cluster: Cluster) -> None:
    with api(cluster) as c:
        ids = [create(c)["sandboxID"] for _ in range(6)]
        nodes = c.get("/nodes").json()
    placed = where(cluster, c)
    assert collections.Counter(placed[i] for i in ids) == {"node1": 2, "node2": 2, "node3": 2}
    assert sorted(n["nodeID"] for n in nodes) == ["node1", "node2", "node3"]
    for n in nodes:
        assert n["state"] == "ready" and n["sandboxes"] == 2 and n["used"]["sandboxes"] == 2
        assert n["address"] == cluster.node(n["nodeID"]).url
        assert set(n["capacity"]) == {"cpuCount", "memoryMiB", "maxSandboxes"}
        assert n["lastHeartbeat"].endswith("Z")


def test_idempotency_keys_hold_across_nodes(cluster: Cluster) -> None:
    """The same Idempotency-Key makes one sandbox, however many creates carry it and
    wherever the scheduler would have put them (least-loaded moves on after each)."""
    body = {"templateID": "base", "metadata": {"k": "v"}}
    with api(cluster) as c:
        first = c.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "k1"}).json()
        again = [c.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "k1"})
                 for _ in range(3)]
        assert [r.status_code for r in again] == [201] * 3
        assert {r.json()["sandboxID"] for r in again} == {first["sandboxID"]}
        r = c.post("/v2/sandboxes", json={**body, "metadata": {"k": "other"}},
                   headers={"Idempotency-Key": "k1"})
        assert r.status_code == 409, r.text
        other = c.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "k2"}).json()
        assert other["sandboxID"] != first["sandboxID"]
        listed = [s["sandboxID"] for s in c.get("/v2/sandboxes").json()]
        assert sorted(listed) == sorted([first["sandboxID"], other["sandboxID"]])

    async def concurrent() -> set[str]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30,
                                     headers={"X-API-Key": API_KEY}) as ac:
            rs = await asyncio.gather(*(ac.post("/v2/sandboxes", json=body,
                                                headers={"Idempotency-Key": "k3"})
                                        for _ in range(6)))
        assert [r.status_code for r in rs] == [201] * 6, [r.text for r in rs]
        return {r.json()["sandboxID"] for r in rs}

    assert len(asyncio.run(concurrent())) == 1


def test_sandbox_calls_reach_its_node(cluster: Cluster) -> None:
    with api(cluster) as c:
        sb = create(c, metadata={"k": "v"})
        sid = sb["sandboxID"]
        assert sb["envdAccessToken"] and sb["domain"] == DOMAIN
        info = c.get(f"/sandboxes/{sid}").json()
        assert info["state"] == "running" and info["metadata"] == {"k": "v"}
        assert c.post(f"/sandboxes/{sid}/timeout", json={"timeout": 600}).status_code == 204
        assert c.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
        assert c.post(f"/sandboxes/{sid}/pause", json={}).status_code == 409
        assert c.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        r = c.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60})
        assert r.status_code == 201 and r.json()["sandboxID"] == sid
        assert c.post(f"/v2/sandboxes/{sid}/connect", json={}).status_code == 200
        forks = c.post(f"/sandboxes/{sid}/fork", json={"count": 2})
        assert forks.status_code == 201, forks.text
        children = [f["sandbox"]["sandboxID"] for f in forks.json()]
        placed = where(cluster, c)
        assert {placed[x] for x in children} == {placed[sid]}   # forks stay on the parent's node
        for x in (sid, *children):
            assert c.delete(f"/sandboxes/{x}").status_code == 204
        assert c.delete(f"/sandboxes/{sid}").status_code == 404
        r = c.get(f"/sandboxes/{sid}")
        assert r.status_code == 404 and r.json()["code"] == 404


def test_list_merges_nodes_with_pagination(cluster: Cluster) -> None:
    with api(cluster) as c:
        ids = {create(c, metadata={"run": "p"})["sandboxID"] for _ in range(7)}
        for order in ("desc", "asc"):
            seen, token, pages = [], None, 0
            while True:
                params = {"limit": 3, "order": order, "metadata": "run=p"}
                if token:
                    params["nextToken"] = token
                r = c.get("/v2/sandboxes", params=params)
                assert r.status_code == 200, r.text
                seen += r.json()
                pages += 1
                token = r.headers.get("x-next-token")
                if not token:
                    break
            assert pages == 3 and len(seen) == 7 and {s["sandboxID"] for s in seen} == ids
            starts = [s["startedAt"] for s in seen]
            assert starts == sorted(starts, reverse=order == "desc")
        paused = next(iter(ids))
        c.post(f"/sandboxes/{paused}/pause", json={})
        r = c.get("/v2/sandboxes", params={"state": "paused"})
        assert [s["sandboxID"] for s in r.json()] == [paused]
        assert len(c.get("/sandboxes").json()) == 6            # v1: running ones
        r = c.get("/v2/sandboxes", params={"limit": 0})
        assert r.status_code == 400 and "limit" in r.json()["message"]
        r = c.get("/v2/sandboxes", params={"nextToken": "garbage"})
        assert r.status_code == 400


def test_snapshots_through_gateway(cluster: Cluster) -> None:
    with api(cluster) as c:
        sids = [create(c)["sandboxID"] for _ in range(3)]
        names = []
        for i, sid in enumerate(sids):
            r = c.post(f"/sandboxes/{sid}/snapshots", json={"name": f"snap{i}"})
            assert r.status_code == 201, r.text
            names.append(r.json()["snapshotID"])
        seen, token = [], None
        while True:
            r = c.get("/snapshots", params={"limit": 2, **({"nextToken": token} if token else {})})
            seen += [s["snapshotID"] for s in r.json()]
            token = r.headers.get("x-next-token")
            if not token:
                break
        assert sorted(seen) == sorted(names)
        r = c.get("/snapshots", params={"sandboxID": sids[0]})
        assert [s["snapshotID"] for s in r.json()] == [names[0]]
        assert c.delete(f"/templates/{names[1]}").status_code == 204
        assert c.delete(f"/templates/{names[1]}").status_code == 404


def test_api_key_and_errors(cluster: Cluster) -> None:
    r = httpx.get(f"{cluster.url}/nodes")
    assert r.status_code == 401 and r.json()["code"] == 401
    r = httpx.get(f"{cluster.url}/nodes", headers={"X-API-Key": "wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{cluster.url}/health").json() == {"status": "ok"}
    with api(cluster) as c:
        assert c.get("/nodes/nope").status_code == 404
        one = c.get("/nodes/node1").json()
        assert one["nodeID"] == "node1" and one["lostSandboxes"] == []
        r = c.get("/v3/templates/x")
        assert r.status_code == 404 and r.json()["code"] == 404
        assert c.get("/nope").json() == {"code": 404, "message": "Not Found"}


def test_traffic_reaches_the_right_node(cluster: Cluster) -> None:
    with api(cluster) as c:
        sids = [create(c)["sandboxID"] for _ in range(3)]
    placed = where(cluster, c)
    for sid in sids:
        # E2B_SANDBOX_URL mode: routed by headers
        r = httpx.post(f"{cluster.url}/echo?x=1", content=b"hi",
                       headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(USER_PORT)})
        assert r.status_code == 200, r.text
        assert r.json()["node"] == placed[sid] and r.json()["body"] == "hi"
        # E2B_DOMAIN mode: routed by host
        r = httpx.get(f"{cluster.url}/by-host",
                      headers={"Host": f"{USER_PORT}-{sid}.{DOMAIN}"})
        assert r.json()["node"] == placed[sid] and r.json()["host"] == f"{USER_PORT}-{sid}.{DOMAIN}"
    r = httpx.get(f"{cluster.url}/x", headers={"E2b-Sandbox-Id": "nosuch",
                                               "E2b-Sandbox-Port": "8000"})
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    r = httpx.get(f"{cluster.url}/x", headers={"E2b-Sandbox-Id": sids[0]})
    assert r.status_code == 400 and "E2b-Sandbox-Port" in r.json()["message"]

    async def ws(sid: str) -> str:
        uri = f"ws://127.0.0.1:{cluster.gateway_port}/ws"
        async with websockets.connect(uri, additional_headers={
                "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(USER_PORT)}) as conn:
            await conn.send("ping")
            return str(await conn.recv())

    for sid in sids:
        assert asyncio.run(ws(sid)) == f"{placed[sid]}:ping"


def test_round_robin(make_cluster) -> None:
    from host.cluster.placement import Strategy
    cluster = make_cluster(strategy=Strategy.ROUND_ROBIN)
    with api(cluster) as c:
        ids = [create(c)["sandboxID"] for _ in range(6)]
    placed = where(cluster, c)
    order = [placed[i] for i in ids]
    assert order[:3] == order[3:] and sorted(order[:3]) == ["node1", "node2", "node3"]


def test_gateway_without_redis() -> None:
    """Redis down: API calls are retryable 503s, traffic too (not "sandbox not found")."""
    from host.api import ApiKeys, NodeKeys
    from host.cluster.config import GatewayConfig
    from host.cluster.gateway import build_gateway
    from tests.api.conftest import free_port

    from .harness import NODE_KEY, Served

    cfg = GatewayConfig(redis=f"redis://127.0.0.1:{free_port()}/0",
                        scheduler=f"http://127.0.0.1:{free_port()}")
    with Served(build_gateway(cfg, keys=ApiKeys([API_KEY]), node_keys=NodeKeys([NODE_KEY])),
                lifespan="on") as gw:
        r = httpx.get(f"{gw.url}/nodes", headers={"X-API-Key": API_KEY})
        assert r.status_code == 503 and r.json()["error_code"] == "cluster_store_unavailable"
        assert "should-retry" not in r.headers
        assert httpx.get(f"{gw.url}/health").status_code == 503
        r = httpx.get(f"{gw.url}/", headers={"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "1"})
        assert r.status_code == 503 and "was not found" not in r.json()["message"]
