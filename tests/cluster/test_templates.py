"""Templates in a cluster (host/cluster/gateway/templates.py, host/orchestrator/templates/catalog.py):
the real Python SDK's `Template.build` through the gateway builds on one node (COPY upload
relayed to it), sandboxes from the template start on every node, tags and rebuilds go to
its home node, the list shows it once, a delete is refused while any node runs a sandbox
from it, and a named snapshot of one node starts sandboxes on the others.

Three real nodes over the fake runtime (harness.py), sharing one repository; the VM
version is in tests/e2e/test_cluster.py."""

from __future__ import annotations

import collections
import os

import httpx
import redis
from e2b import Sandbox, Template

from .harness import Cluster
from .test_gateway import api, create, where
from .test_sdk import sdk  # noqa: F401 - the SDK pointed at the gateway


def home_of(cluster: Cluster, ref: str) -> str:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        return str(client.get(f"aenv:template:{ref}"))
    finally:
        client.close()


def test_a_template_built_through_the_gateway_serves_every_node(
        sdk: Cluster, tmp_path) -> None:  # noqa: F811 - the imported fixture
    (tmp_path / "a.txt").write_text("hello\n")
    os.chmod(tmp_path / "a.txt", 0o644)
    t = (Template(file_context_path=tmp_path).from_template("base").copy("a.txt", "/app/")
         .set_workdir("/app"))
    logs: list = []
    info = Template.build(t, "shared-tpl", on_build_logs=logs.append)
    assert [e.message for e in logs][-1] == "Build finished"
    home = home_of(sdk, info.template_id)
    assert home == home_of(sdk, "shared-tpl") and home in ("node1", "node2", "node3")
    uploaded = [n.node_id for n in sdk.nodes if any((n.state_dir / "template-files").glob("*"))]
    assert uploaded == [home]   # the COPY archive went to the node that built it

    boxes = [Sandbox.create(template="shared-tpl") for _ in range(6)]
    with api(sdk) as c:
        placed = where(sdk, c)
        assert collections.Counter(placed[b.sandbox_id] for b in boxes) == {
            "node1": 2, "node2": 2, "node3": 2}
        for b in boxes:
            assert b.get_info().template_id == info.template_id
        listed = c.get("/templates").json()
        assert [x["templateID"] for x in listed] == [info.template_id]
        r = c.get("/v2/templates", params={"limit": 1})
        assert [x["templateID"] for x in r.json()] == [info.template_id]
        assert "x-next-token" not in r.headers
        # a delete is refused while a node runs a sandbox from it, and nothing is lost
        r = c.delete("/templates/shared-tpl")
        assert r.status_code == 400 and "used by" in r.json()["message"], r.text

    # tags and a rebuild go to the home node (it has the COPY archive already)
    assert Template.exists("shared-tpl")
    logs.clear()
    Template.build(t, "shared-tpl:v2", on_build_logs=logs.append)
    assert "Skipping upload of 'a.txt', already cached" in [e.message for e in logs]
    assert Template.assign_tags("shared-tpl:v2", ["stable"]).tags == ["stable"]
    assert sorted(x.tag for x in Template.get_tags("shared-tpl")) == ["default", "stable", "v2"]
    stable = Sandbox.create(template="shared-tpl:stable")
    boxes.append(stable)
    Template.remove_tags("shared-tpl", ["stable"])
    assert sorted(x.tag for x in Template.get_tags("shared-tpl")) == ["default", "v2"]

    for b in boxes:
        assert b.kill() is True
    with api(sdk) as c:
        assert c.delete("/templates/shared-tpl").status_code == 204
        assert c.get("/templates").json() == []
        r = c.post("/v2/sandboxes", json={"templateID": "shared-tpl"})
        assert r.status_code == 404, r.text
    assert not Template.exists("shared-tpl")


def test_a_named_snapshot_of_one_node_starts_sandboxes_on_the_others(cluster: Cluster) -> None:
    with api(cluster) as c:
        src = create(c)["sandboxID"]
        r = c.post(f"/sandboxes/{src}/snapshots", json={"name": "golden"})
        assert r.status_code == 201, r.text
        snap = r.json()["snapshotID"]
        made = [create(c, templateID=snap)["sandboxID"] for _ in range(5)]
        placed = where(cluster, c)
        assert len({placed[s] for s in made}) == 3   # least-loaded: every node took some
        listed = c.get("/snapshots").json()
        assert [s["snapshotID"] for s in listed] == [snap]   # once: by its own node


def test_upload_urls_point_at_the_gateway(cluster: Cluster) -> None:
    with api(cluster) as c:
        r = c.post("/v3/templates", json={"name": "up"})
        assert r.status_code == 202, r.text
        tid = r.json()["templateID"]
        home = home_of(cluster, tid)
        files_hash = "ab" * 32
        r = c.get(f"/templates/{tid}/files/{files_hash}")
        assert r.status_code == 201, r.text
        url = r.json()["url"]
        assert url.startswith(f"{cluster.url}/template-files/{home}/{files_hash}?expires=")
        assert httpx.put(url, content=b"archive").status_code == 200   # no API key: signed
        assert c.get(f"/templates/{tid}/files/{files_hash}").json()["present"] is True
        r = httpx.put(url.replace("signature=", "signature=0"), content=b"x")
        assert r.status_code in (400, 403)
        r = httpx.put(url.replace(f"/{home}/", "/nonode/"), content=b"x")
        assert r.status_code == 404 and "ask for a new URL" in r.json()["message"]
        r = c.post("/v3/templates", json={})
        assert r.status_code == 400
