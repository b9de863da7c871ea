"""GET /metrics of the gateway and the scheduler over a real cluster (harness.py): no API
key, the Prometheus text format (parsed with prometheus_client's parser,
tests/metrics/scrape.py), each service's own families only, and exact deltas around a
create, a create refused at capacity, a pause, sandbox traffic (HTTP and WebSocket), the
gateway's own refusals, and a node that dies; the Redis index read at scrape time (left
out when Redis fails, bounded in time when it does not answer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
import websockets

from host.api import ApiKeys, NodeKeys
from host.cluster.config import GatewayConfig, SchedulerConfig
from host.cluster.gateway import build_gateway
from host.cluster.gateway.metrics import binding_counts
from host.cluster.registry import Registry
from host.cluster.scheduler import build_scheduler_app
from host.cluster.scheduler.metrics import node_counts
from host.cluster.store import ClusterStore, Keys
from tests.api.conftest import API_KEY, free_port
from tests.metrics.scrape import Scrape, parse

from .harness import NODE_KEY, USER_PORT, Cluster, Served, listen_socket
from .test_failover import DEAD_BOUND_S
from .test_gateway import api, create, where

GATEWAY_FAMILIES = {"aenv_gateway_requests_total": "counter",
                    "aenv_gateway_sandbox_bytes_total": "counter",
                    "aenv_gateway_node_call_seconds": "histogram",
                    "aenv_gateway_placement_seconds": "histogram",
                    "aenv_gateway_errors_total": "counter",
                    "aenv_cluster_nodes": "gauge",
                    "aenv_cluster_sandboxes": "gauge"}
SCHEDULER_FAMILIES = {"aenv_scheduler_placements_total": "counter",
                      "aenv_scheduler_placement_seconds": "histogram",
                      "aenv_scheduler_nodes_declared_dead_total": "counter",
                      "aenv_scheduler_sandboxes_lost_total": "counter",
                      "aenv_cluster_nodes": "gauge"}
# the families parsed by prometheus_client are named without `_total`
_FAMILY = {name: name.removesuffix("_total") for name in
           [*GATEWAY_FAMILIES, *SCHEDULER_FAMILIES]}


def page(url: str) -> Scrape:
    """GET <url>/metrics without an API key: 200, the text format, parsed."""
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version="), r.headers
    return parse(r.text)


def settled(url: str, ready: Callable[[Scrape], bool], timeout_s: float = 10.0) -> Scrape:
    """Scrape until `ready(page)`: requests are counted when they end, a moment after the
    client has its answer (a WebSocket session: after its close handshake)."""
    deadline = time.monotonic() + timeout_s
    while True:
        scraped = page(url)
        if ready(scraped):
            return scraped
        assert time.monotonic() < deadline, "the metrics did not settle"
        time.sleep(0.05)


def requests(p: Scrape, kind: str, status: str) -> float:
    return p.total("aenv_gateway_requests_total", kind=kind, status=status)


def scheduler_url(cluster: Cluster) -> str:
    return f"http://127.0.0.1:{cluster.scheduler_port}"


def heartbeats(cluster: Cluster, node_id: str, n: int = 2, timeout_s: float = 10.0) -> None:
    """Wait for `n` more heartbeats of the node (the last one reported after this call)."""
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        deadline = time.monotonic() + timeout_s
        seen = client.hget(Keys().node(node_id), "lastHeartbeatMs")
        while n:
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.02)
            now = client.hget(Keys().node(node_id), "lastHeartbeatMs")
            if now != seen:
                seen, n = now, n - 1
    finally:
        client.close()


def assert_no_ids(p: Scrape, ids: list[str]) -> None:
    """No sample names a sandbox in its labels (bounded label sets)."""
    for (_, labels) in p.samples:
        for _, value in labels:
            assert not any(sid in value for sid in ids), value


def test_pages_hold_each_service_s_own_families(cluster: Cluster) -> None:
    g, s = page(cluster.url), page(scheduler_url(cluster))
    for families, p in ((GATEWAY_FAMILIES, g), (SCHEDULER_FAMILIES, s)):
        for name, kind in families.items():
            assert p.types[_FAMILY[name]] == kind, name
        # not the node's families (host/metrics' Metrics): only their own instruments
        assert not {n for n in p.names() if n.startswith(("aenv_sandbox", "aenv_proxy"))}
    assert g.value("aenv_cluster_nodes", state="ready") == 3
    assert g.value("aenv_cluster_nodes", state="dead") == 0
    assert g.value("aenv_cluster_nodes", state="draining") == 0
    assert s.value("aenv_cluster_nodes", state="ready") == 3
    for state in ("running", "paused", "lost"):
        assert g.value("aenv_cluster_sandboxes", state=state) == 0
    for op in ("create", "connect", "pause", "kill", "list", "other"):
        assert g.value("aenv_gateway_node_call_seconds_count", operation=op) == 0
    for kind in ("create", "resume", "fork"):
        assert s.value("aenv_scheduler_placement_seconds_count", kind=kind) == 0
        for outcome in ("placed", "capacity", "error"):
            assert s.value("aenv_scheduler_placements_total", kind=kind, outcome=outcome) == 0
    # scrapes and health checks are not requests the gateway counts
    httpx.get(f"{cluster.url}/health")
    again = page(cluster.url)
    assert again.total("aenv_gateway_requests_total") == g.total("aenv_gateway_requests_total")


def test_create_capacity_refusal_and_pause(make_cluster) -> None:
    cluster = make_cluster(nodes=1, max_sandboxes=1)
    gw, sch = cluster.url, scheduler_url(cluster)
    g0, s0 = page(gw), page(sch)
    with api(cluster) as c:
        # a create: placed by the scheduler, created on the node, bound running
        sid = create(c)["sandboxID"]
        g1 = settled(gw, lambda p: requests(p, "api", "2xx") - requests(g0, "api", "2xx") == 1)
        s1 = page(sch)
        assert g1.delta(g0, "aenv_gateway_requests_total") == 1
        assert g1.delta(g0, "aenv_gateway_node_call_seconds_count", operation="create") == 1
        assert g1.delta(g0, "aenv_gateway_node_call_seconds_count") == 1
        assert g1.delta(g0, "aenv_gateway_placement_seconds_count", kind="create") == 1
        assert g1.delta(g0, "aenv_gateway_placement_seconds_count") == 1
        assert g1.delta(g0, "aenv_gateway_errors_total") == 0
        assert g1.value("aenv_cluster_sandboxes", state="running") == 1
        assert g1.value("aenv_cluster_sandboxes", state="paused") == 0
        assert s1.delta(s0, "aenv_scheduler_placements_total", kind="create",
                        outcome="placed") == 1
        assert s1.delta(s0, "aenv_scheduler_placements_total") == 1
        assert s1.delta(s0, "aenv_scheduler_placement_seconds_count", kind="create") == 1
        # the placement's time as the gateway saw it includes the scheduler's own
        assert (g1.delta(g0, "aenv_gateway_placement_seconds_sum", kind="create")
                >= s1.delta(s0, "aenv_scheduler_placement_seconds_sum", kind="create"))

        # the one node is full: the scheduler refuses, no node is called (once a heartbeat
        # reported after the create says so: not one computed before it)
        heartbeats(cluster, "node1")
        r = c.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 429 and r.json()["error_code"] == "sandbox_capacity_unavailable"
        g2 = settled(gw, lambda p: requests(p, "api", "4xx") - requests(g1, "api", "4xx") == 1)
        s2 = page(sch)
        assert g2.delta(g1, "aenv_gateway_requests_total") == 1
        assert g2.delta(g1, "aenv_gateway_errors_total",
                        code="sandbox_capacity_unavailable") == 1
        assert g2.delta(g1, "aenv_gateway_errors_total") == 1
        assert g2.delta(g1, "aenv_gateway_placement_seconds_count", kind="create") == 1
        assert g2.delta(g1, "aenv_gateway_node_call_seconds_count") == 0
        assert g2.value("aenv_cluster_sandboxes", state="running") == 1
        assert s2.delta(s1, "aenv_scheduler_placements_total", kind="create",
                        outcome="capacity") == 1
        assert s2.delta(s1, "aenv_scheduler_placements_total") == 1
        assert s2.delta(s1, "aenv_scheduler_placement_seconds_count", kind="create") == 1

        # a pause: forwarded to the node, the binding follows
        assert c.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
        g3 = settled(gw, lambda p: requests(p, "api", "2xx") - requests(g2, "api", "2xx") == 1)
        s3 = page(sch)
        assert g3.delta(g2, "aenv_gateway_requests_total") == 1
        assert g3.delta(g2, "aenv_gateway_node_call_seconds_count", operation="pause") == 1
        assert g3.delta(g2, "aenv_gateway_node_call_seconds_count") == 1
        assert g3.delta(g2, "aenv_gateway_placement_seconds_count") == 0
        assert g3.delta(g2, "aenv_gateway_errors_total") == 0
        assert g3.value("aenv_cluster_sandboxes", state="running") == 0
        assert g3.value("aenv_cluster_sandboxes", state="paused") == 1
        assert s3.delta(s2, "aenv_scheduler_placements_total") == 0

        # a fork of a sandbox the index does not know: the scheduler's error outcome
        r = httpx.post(f"{sch}/placements", json={"kind": "fork", "sandboxID": "nosuch"},
                       headers={"X-API-Key": NODE_KEY})
        assert r.status_code == 404
        s4 = page(sch)
        assert s4.delta(s3, "aenv_scheduler_placements_total", kind="fork",
                        outcome="error") == 1
        assert s4.delta(s3, "aenv_scheduler_placements_total") == 1
        # a request the scheduler cannot read is no placement (and no label from it)
        assert httpx.post(f"{sch}/placements", json={"kind": "x" * 40},
                          headers={"X-API-Key": NODE_KEY}).status_code == 400
        s5 = page(sch)
        assert s5.delta(s4, "aenv_scheduler_placements_total") == 0
        assert s5.delta(s4, "aenv_scheduler_placement_seconds_count") == 0
    for p in (g1, g2, g3):
        assert_no_ids(p, [sid])
    assert_no_ids(s5, [sid, "nosuch", "x" * 40])


def test_sandbox_traffic_and_refusals(make_cluster) -> None:
    cluster = make_cluster(nodes=1)
    gw = cluster.url
    with api(cluster) as c:
        sid = create(c)["sandboxID"]
    g0 = settled(gw, lambda p: requests(p, "api", "2xx") == 1)

    # HTTP traffic (E2B_SANDBOX_URL mode): body bytes both ways
    body = b"hello, sandbox"
    r = httpx.post(f"{gw}/echo", content=body,
                   headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(USER_PORT)})
    assert r.status_code == 200 and r.json()["body"] == body.decode()
    g1 = settled(gw, lambda p: requests(p, "sandbox-http", "2xx") == 1)
    assert g1.delta(g0, "aenv_gateway_requests_total") == 1
    assert g1.delta(g0, "aenv_gateway_sandbox_bytes_total", direction="in") == len(body)
    assert g1.delta(g0, "aenv_gateway_sandbox_bytes_total", direction="out") == len(r.content)
    # traffic is not an API call into a node
    assert g1.delta(g0, "aenv_gateway_node_call_seconds_count") == 0

    # a WebSocket session: 1xx once accepted, message bytes both ways
    async def ws() -> str:
        uri = f"ws://127.0.0.1:{cluster.gateway_port}/ws"
        async with websockets.connect(uri, additional_headers={
                "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(USER_PORT)}) as conn:
            await conn.send("ping")
            return str(await conn.recv())

    echoed = asyncio.run(ws())
    assert echoed == "node1:ping"
    g2 = settled(gw, lambda p: requests(p, "websocket", "1xx") == 1)
    assert g2.delta(g1, "aenv_gateway_requests_total") == 1
    assert g2.delta(g1, "aenv_gateway_sandbox_bytes_total", direction="in") == len("ping")
    assert g2.delta(g1, "aenv_gateway_sandbox_bytes_total", direction="out") == len(echoed)

    # the gateway's own refusals, by code: no key, an unknown sandbox's traffic, traffic
    # naming no port, an unknown route, an unknown template route
    assert httpx.get(f"{gw}/nodes").status_code == 401
    unknown = "i" + "0" * 20   # an id a node could have issued (others are not looked for)
    r = httpx.get(f"{gw}/x", headers={"E2b-Sandbox-Id": unknown, "E2b-Sandbox-Port": "8000"})
    assert r.status_code == 502
    assert httpx.get(f"{gw}/x", headers={"E2b-Sandbox-Id": sid}).status_code == 400
    with api(cluster) as c:
        assert c.get("/nope").status_code == 404
        assert c.get("/v3/templates/x").status_code == 404
        assert c.get(f"/sandboxes/{sid}").status_code == 200   # a node's answer: no error
        assert c.get("/v2/sandboxes").status_code == 200
    g3 = settled(gw, lambda p: p.delta(g2, "aenv_gateway_requests_total") == 7)
    assert g3.delta(g2, "aenv_gateway_errors_total") == 5
    for code in ("unauthorized", "not_found", "bad_request"):
        want = 3 if code == "not_found" else 1   # the unknown sandbox, the unknown routes
        assert g3.delta(g2, "aenv_gateway_errors_total", code=code) == want, code
    assert g3.delta(g2, "aenv_gateway_requests_total", kind="api", status="4xx") == 3
    assert g3.delta(g2, "aenv_gateway_requests_total", kind="api", status="5xx") == 0
    assert g3.delta(g2, "aenv_gateway_requests_total", kind="api", status="2xx") == 2
    assert g3.delta(g2, "aenv_gateway_requests_total", kind="sandbox-http", status="5xx") == 1
    assert g3.delta(g2, "aenv_gateway_requests_total", kind="sandbox-http", status="4xx") == 1
    # the GET, and the unknown sandbox looked for on the node (it may be younger than
    # the index)
    assert g3.delta(g2, "aenv_gateway_node_call_seconds_count", operation="other") == 2
    assert g3.delta(g2, "aenv_gateway_node_call_seconds_count", operation="list") == 1
    assert_no_ids(g3, [sid, unknown])


def test_a_node_that_dies(make_cluster) -> None:
    cluster = make_cluster(nodes=2)
    gw, sch = cluster.url, scheduler_url(cluster)
    with api(cluster) as c:
        ids = [create(c)["sandboxID"] for _ in range(4)]
        placed = where(cluster, c)
        victim = placed[ids[0]]
        mine = [i for i in ids if placed[i] == victim]
        assert len(mine) == 2
        assert c.post(f"/sandboxes/{mine[1]}/pause", json={}).status_code == 204
    g0, s0 = page(gw), page(sch)
    assert g0.value("aenv_cluster_sandboxes", state="running") == 3
    assert g0.value("aenv_cluster_sandboxes", state="paused") == 1
    cluster.node(victim).stop()
    s1 = settled(sch, lambda p: p.delta(s0, "aenv_scheduler_nodes_declared_dead_total") >= 1,
                 timeout_s=DEAD_BOUND_S + 5)
    assert s1.delta(s0, "aenv_scheduler_nodes_declared_dead_total") == 1
    assert s1.delta(s0, "aenv_scheduler_sandboxes_lost_total") == 1   # the paused one is not
    assert s1.value("aenv_cluster_nodes", state="dead") == 1
    assert s1.value("aenv_cluster_nodes", state="ready") == 1
    g1 = page(gw)
    assert g1.value("aenv_cluster_nodes", state="dead") == 1
    assert g1.value("aenv_cluster_nodes", state="ready") == 1
    assert g1.value("aenv_cluster_sandboxes", state="lost") == 1
    assert g1.value("aenv_cluster_sandboxes", state="paused") == 1
    assert g1.value("aenv_cluster_sandboxes", state="running") == 2
    time.sleep(0.5)   # more sweeps: a death is counted once
    assert page(sch).delta(s0, "aenv_scheduler_nodes_declared_dead_total") == 1


def test_metrics_need_no_key_where_the_scheduler_wants_one(redis_url: str,
                                                           tmp_path: Path) -> None:
    keys = tmp_path / "node_key"
    keys.write_text(NODE_KEY + "\n")
    cfg = SchedulerConfig(redis=redis_url, node_key_file=keys)
    with Served(build_scheduler_app(cfg), lifespan="on") as sch:
        assert httpx.post(f"{sch.url}/placements", json={}).status_code == 401
        p = page(sch.url)
        assert p.value("aenv_cluster_nodes", state="ready") == 0
        assert p.total("aenv_scheduler_placements_total") == 0


def test_redis_down_leaves_the_index_out() -> None:
    """Redis refusing connections: the page still answers, without the index's families;
    the gateway's errors are counted."""
    cfg = GatewayConfig(redis=f"redis://127.0.0.1:{free_port()}/0",
                        scheduler=f"http://127.0.0.1:{free_port()}")
    with Served(build_gateway(cfg, keys=ApiKeys([API_KEY]), node_keys=NodeKeys([NODE_KEY])),
                lifespan="on") as gw:
        p0 = page(gw.url)
        assert "aenv_cluster_nodes" not in p0.names()
        assert "aenv_cluster_sandboxes" not in p0.names()
        assert p0.types["aenv_gateway_requests"] == "counter"
        r = httpx.get(f"{gw.url}/nodes", headers={"X-API-Key": API_KEY})
        assert r.status_code == 503
        p1 = settled(gw.url, lambda p: p.total("aenv_gateway_requests_total") == 1)
        assert p1.delta(p0, "aenv_gateway_errors_total", code="cluster_store_unavailable") == 1
        assert p1.delta(p0, "aenv_gateway_requests_total", kind="api", status="5xx") == 1
    cfg_s = SchedulerConfig(redis=cfg.redis)
    with Served(build_scheduler_app(cfg_s), lifespan="on") as sch:
        r = httpx.post(f"{sch.url}/placements", json={})
        assert r.status_code == 503
        p = page(sch.url)
        assert "aenv_cluster_nodes" not in p.names()
        assert p.value("aenv_scheduler_placements_total", kind="create", outcome="error") == 1


def test_a_silent_redis_bounds_the_scrape() -> None:
    """A Redis that accepts connections and never answers: the reads give up in time."""
    sock = listen_socket()
    sock.listen()
    store = ClusterStore.from_url(f"redis://127.0.0.1:{sock.getsockname()[1]}/0")

    async def both() -> None:
        for read in (node_counts(Registry(store), timeout_s=0.3),
                     binding_counts(store, timeout_s=0.3)):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await read
            assert time.monotonic() - t0 < 2
        await store.aclose()

    try:
        asyncio.run(both())
    finally:
        sock.close()
