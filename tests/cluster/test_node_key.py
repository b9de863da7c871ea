"""The node key across a running cluster (harness.py: nodes, scheduler and gateway on
loopback): the gateway and the scheduler use it, clients' API keys never open the nodes'
/cluster/ routes nor the scheduler, and the node key is not a client key at the gateway."""

from __future__ import annotations

import httpx

from tests.api.conftest import API_KEY

from .harness import NODE_KEY, Cluster
from .test_gateway import api, create


def test_client_key_does_not_open_cluster_routes(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    body = {"sandboxID": "x", "token": "t"}
    # an API key the node itself accepts for its public API...
    assert httpx.get(f"{node.url}/v2/sandboxes",
                     headers={"X-API-Key": API_KEY}).status_code == 200
    # ...is refused on every cluster route
    for method, path in (("POST", "/cluster/signer"), ("POST", "/cluster/sandboxes/x/adopt"),
                         ("DELETE", "/cluster/sandboxes/x")):
        r = httpx.request(method, f"{node.url}{path}", json=body,
                          headers={"X-API-Key": API_KEY})
        assert r.status_code == 403 and "node key" in r.json()["message"], (path, r.text)
        r = httpx.request(method, f"{node.url}{path}", json=body)
        assert r.status_code == 401
    # the node key passes the check (the handler answers: no such sandbox here)
    r = httpx.post(f"{node.url}/cluster/sandboxes/nosuch/adopt",
                   headers={"X-API-Key": NODE_KEY})
    assert r.status_code == 404, r.text


def test_node_key_is_not_a_client_key_at_the_gateway(cluster: Cluster) -> None:
    r = httpx.get(f"{cluster.url}/nodes", headers={"X-API-Key": NODE_KEY})
    assert r.status_code == 401
    with api(cluster) as c:   # while clients' calls reach the nodes with the node key
        sid = create(c)["sandboxID"]
        assert c.get(f"/sandboxes/{sid}").status_code == 200
        assert c.get("/nodes").status_code == 200


def test_scheduler_takes_the_node_key_only(cluster: Cluster) -> None:
    url = f"http://127.0.0.1:{cluster.scheduler_port}/placements"
    assert httpx.post(url, json={}, headers={"X-API-Key": API_KEY}).status_code == 401
    assert httpx.post(url, json={}).status_code == 401
    r = httpx.post(url, json={}, headers={"X-API-Key": NODE_KEY})
    assert r.status_code == 201 and r.json()["nodeID"].startswith("node"), r.text
