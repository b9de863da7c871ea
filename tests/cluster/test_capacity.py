"""Capacity: 60 creates at once through the gateway spread over the nodes without an
error, and when every node is full the gateway answers with E2B's capacity error."""

from __future__ import annotations

import asyncio
import collections
import time

import httpx

from tests.api.conftest import API_KEY

from .harness import Cluster
from .test_gateway import api, create, where


def test_sixty_concurrent_creates_spread(cluster: Cluster) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.url, headers={"X-API-Key": API_KEY},
                                     timeout=120) as c:
            return await asyncio.gather(*(c.post("/v2/sandboxes", json={"templateID": "base"})
                                          for _ in range(60)))

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [201] * 60, [r.text for r in answers
                                                           if r.status_code != 201][:3]
    ids = {r.json()["sandboxID"] for r in answers}
    assert len(ids) == 60
    with api(cluster) as c:
        placed = where(cluster, c)
        counts = collections.Counter(placed[i] for i in ids)
        assert set(counts) == {"node1", "node2", "node3"}
        assert max(counts.values()) - min(counts.values()) <= 6, counts
        nodes = {n["nodeID"]: n for n in c.get("/nodes").json()}
        assert sum(n["sandboxes"] for n in nodes.values()) == 60
        assert {nid: n["sandboxes"] for nid, n in nodes.items()} == dict(counts)


def test_capacity_error_when_every_node_is_full(make_cluster) -> None:
    cluster = make_cluster(max_sandboxes=2)
    with api(cluster) as c:
        ids = [create(c)["sandboxID"] for _ in range(6)]
        placed = where(cluster, c)
        assert collections.Counter(placed[i] for i in ids) == {"node1": 2, "node2": 2,
                                                                 "node3": 2}
        r = c.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 429, r.text
        body = r.json()
        assert body["code"] == 429 and body["error_code"] == "sandbox_capacity_unavailable"
        assert all(f"node{i}: full" in body["message"] for i in (1, 2, 3)), body["message"]
        assert r.headers["retry-after"] == "5" and "should-retry" not in r.headers
        # pausing one frees its VM's place: the next create lands there
        assert c.post(f"/sandboxes/{ids[0]}/pause", json={}).status_code == 204
        freed = placed[ids[0]]

        def lands() -> bool:
            r = c.post("/v2/sandboxes", json={"templateID": "base"})
            return r.status_code == 201 and where(cluster, c)[r.json()["sandboxID"]] == freed

        deadline = time.monotonic() + 5
        while not lands():   # once the node's heartbeat says it holds one VM fewer
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_node_refusal_moves_the_create_elsewhere(make_cluster) -> None:
    """A node whose admission refuses (its heartbeat not yet showing it full) is skipped."""
    cluster = make_cluster(max_sandboxes=1)
    with api(cluster) as c:
        for node in cluster.nodes[:2]:   # fill two nodes behind the scheduler's back
            r = httpx.post(f"{node.url}/v2/sandboxes", json={"templateID": "base"},
                           headers={"X-API-Key": API_KEY})
            assert r.status_code == 201
        sid = create(c)["sandboxID"]
        assert where(cluster, c)[sid] == "node3"
        r = c.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 429 and r.json()["code"] == 429
