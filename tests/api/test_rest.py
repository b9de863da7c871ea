"""REST mapping tests: exact codes, E2B error bodies, filters, pagination, legacy routes.

Runs the API against an in-memory Orchestrator double (tests/api/double.py), allowed here
ONLY as a unit test of the HTTP mapping; no VM is involved.
"""

from __future__ import annotations

import urllib.parse

import httpx
import pytest

from host.orchestrator.errors import GuestUnresponsive
from host.orchestrator.states import SandboxState

from .conftest import API_KEY
from .double import FakeOrchestrator


def assert_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]
    return body


def sdk_metadata(meta: dict[str, str]) -> str:
    """The `metadata` query value exactly as the Python SDK builds it (paginator.py)."""
    return urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v)
                                   for k, v in meta.items()})


async def test_health_is_503_with_reasons_while_the_node_takes_no_sandboxes(
        client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    orch.unhealthy = ["this node's disk is nearly full: 10 MiB free"]
    resp = await client.get("/health")
    assert resp.status_code == 503
    assert resp.json() == {"status": "unhealthy",
                           "reasons": ["this node's disk is nearly full: 10 MiB free"]}
    # a liveness probe: the process answers, a restart would not free the disk
    live = await client.get("/health", params={"probe": "live"})
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    assert (await client.get("/health", params={"probe": "nonsense"})).status_code == 400
    orch.unhealthy = []
    assert (await client.get("/health")).json() == {"status": "ok"}


async def test_admin_gc_runs_the_collector_or_a_dry_run(
        client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    resp = await client.post("/admin/gc", params={"dryRun": "true"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["dryRun"] is True and resp.json()["records"] == {"sandboxes": 0}
    assert (await client.post("/admin/gc")).json()["dryRun"] is False
    assert orch.calls[-2:] == [("collect", (True,)), ("collect", (False,))]
    assert (await client.post("/admin/gc", headers={"X-API-Key": "wrong"})).status_code == 401


async def test_health_is_open(client: httpx.AsyncClient) -> None:
    resp = await client.get("/health", headers={"X-API-Key": ""})
    assert resp.status_code == 200


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "wrong"}])
async def test_bad_api_key_is_401(client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    client.headers.pop("X-API-Key")
    assert_error(await client.get("/v2/sandboxes", headers=headers), 401)


async def test_api_key_header_is_case_insensitive(client: httpx.AsyncClient) -> None:
    client.headers.pop("X-API-Key")
    resp = await client.get("/v2/sandboxes", headers={"x-api-KEY": API_KEY})
    assert resp.status_code == 200


async def test_create_v2_is_201_with_required_fields(client, orch: FakeOrchestrator) -> None:
    resp = await client.post("/v2/sandboxes", json={
        "templateID": "base", "metadata": {"a": "b"}, "envVars": {}, "timeout": 60,
        "autoPause": False, "autoResume": {"enabled": True}, "allow_internet_access": False,
        "autoPauseMemory": False,
        "network": {"allowPublicTraffic": False, "allowOut": ["1.1.1.1"]}})
    assert resp.status_code == 201
    body = resp.json()
    assert body["sandboxID"].isalnum() and body["clientID"] and body["envdVersion"] == "0.6.13"
    assert body["envdAccessToken"] and body["domain"] == "sbx.test"
    assert body["trafficAccessToken"] == "traffic"
    req = orch.calls[0][1][0]
    assert (req.timeout_s, req.auto_pause, req.auto_resume, req.secure) == (60, False, True, True)
    assert req.auto_pause_memory is False
    assert req.network.allow_out == ("1.1.1.1",) and "0.0.0.0/0" in req.network.deny_out


async def test_legacy_create_token_only_when_secure(client) -> None:
    plain = await client.post("/sandboxes", json={"templateID": "base", "timeout": 300})
    assert plain.status_code == 201 and "envdAccessToken" not in plain.json()
    secure = await client.post("/sandboxes", json={"templateID": "base", "secure": True})
    assert secure.status_code == 201 and secure.json()["envdAccessToken"]


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"templateID": 5}', "'templateID' must be a string"),
    (b'{"templateID": "base", "timeout": "60"}', "'timeout' must be an integer"),
    (b'{"templateID": "base", "timeout": true}', "'timeout' must be an integer"),
    (b'{"templateID": "base", "metadata": {"a": 1}}', "'metadata.a' must be a string"),
    (b'{"templateID": "base", "network": []}', "'network' must be an object"),
    (b'{"templateID": "base", "timeout": -1}', "between 0"),
    (b"", "required"),
    (b"\xff\xfe", "not valid JSON"),
])
async def test_malformed_create_is_400(client, body: bytes, needle: str) -> None:
    resp = await client.post("/v2/sandboxes", content=body,
                             headers={"Content-Type": "application/json"})
    assert needle in assert_error(resp, 400)["message"]


async def test_idempotency_key(client, orch: FakeOrchestrator) -> None:
    body = {"templateID": "base", "metadata": {"x": "1"}}
    h = {"Idempotency-Key": "abc-123"}
    first = await client.post("/v2/sandboxes", json=body, headers=h)
    again = await client.post("/v2/sandboxes", json=body, headers=h)
    assert first.status_code == again.status_code == 201
    assert first.json()["sandboxID"] == again.json()["sandboxID"]
    other = await client.post("/v2/sandboxes", json={**body, "metadata": {"x": "2"}}, headers=h)
    assert assert_error(other, 409)["error_code"] == "idempotency_request_mismatch"
    assert_error(await client.post("/v2/sandboxes", json=body,
                                   headers={"Idempotency-Key": ""}), 400)


async def test_get_detail(client, orch: FakeOrchestrator) -> None:
    info = orch.add(metadata={"k": "v"})
    resp = await client.get(f"/sandboxes/{info.sandbox_id}")
    assert resp.status_code == 200
    body = resp.json()
    assert body["state"] == "running" and body["envdAccessToken"] == "envd-token"
    assert body["domain"] == "sbx.test" and body["clientID"] and body["metadata"] == {"k": "v"}
    assert body["lifecycle"] == {"autoResume": False, "onTimeout": "pause"}
    assert body["startedAt"].endswith("Z") and body["cpuCount"] == 2


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/sandboxes/{id}", None),
    ("DELETE", "/sandboxes/{id}", None),
    ("POST", "/sandboxes/{id}/timeout", {"timeout": 10}),
    ("POST", "/sandboxes/{id}/pause", {}),
    ("POST", "/v2/sandboxes/{id}/connect", {}),
    ("POST", "/sandboxes/{id}/connect", {"timeout": 10}),
    ("POST", "/sandboxes/{id}/resume", {}),
    ("POST", "/sandboxes/{id}/refreshes", {"duration": 10}),
    ("POST", "/sandboxes/{id}/snapshots", {}),
    ("POST", "/sandboxes/{id}/fork", {}),
    ("GET", "/sandboxes/{id}/metrics", None),
    ("GET", "/sandboxes/{id}/logs", None),
    ("GET", "/v2/sandboxes/{id}/logs", None),
    ("PUT", "/sandboxes/{id}/network", {}),
])
async def test_unknown_sandbox_is_404(client, method: str, path: str, body) -> None:
    resp = await client.request(method, path.format(id="inope"), json=body)
    assert "inope" in assert_error(resp, 404)["message"]


async def test_exact_success_codes_and_empty_204(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    for method, path, body in [("POST", "timeout", {"timeout": 30}),
                               ("POST", "refreshes", {"duration": 3600}),
                               ("PUT", "network", {"allowOut": ["10.0.0.1"]}),
                               ("POST", "pause", {})]:
        resp = await client.request(method, f"/sandboxes/{sid}/{path}", json=body)
        assert resp.status_code == 204 and resp.content == b"", (path, resp.text)
    assert ("set_timeout", (sid, 30)) in orch.calls
    assert ("extend_timeout", (sid, 3600)) in orch.calls
    # pausing a paused sandbox -> 409
    assert_error(await client.post(f"/sandboxes/{sid}/pause", json={}), 409)
    # connect resumes it -> 201, then 200 while running
    resp = await client.post(f"/v2/sandboxes/{sid}/connect", json={})
    assert resp.status_code == 201 and resp.json()["sandboxID"] == sid
    resp = await client.post(f"/v2/sandboxes/{sid}/connect", content=b"")
    assert resp.status_code == 200
    kill = await client.delete(f"/sandboxes/{sid}")
    assert kill.status_code == 204 and kill.content == b""
    assert_error(await client.delete(f"/sandboxes/{sid}"), 404)


async def test_filesystem_pause_reboot_and_strict(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    resp = await client.post(f"/sandboxes/{sid}/pause", json={"memory": False})
    assert resp.status_code == 204
    assert ("pause", (sid, False, False)) in orch.calls
    assert (await client.get(f"/sandboxes/{sid}")).json()["pauseMode"] == "filesystem"
    resp = await client.post(f"/v2/sandboxes/{sid}/connect", json={"memory": False})
    assert resp.status_code == 201 and ("connect", (sid, None, False)) in orch.calls
    assert "pauseMode" not in (await client.get(f"/sandboxes/{sid}")).json()
    resp = await client.post(f"/sandboxes/{sid}/pause", json={"requireHealthyGuest": True})
    assert resp.status_code == 204 and ("pause", (sid, True, True)) in orch.calls
    assert (await client.get(f"/sandboxes/{sid}")).json()["pauseMode"] == "full"
    assert_error(await client.post(f"/sandboxes/{sid}/pause", json={"memory": "no"}), 400)


async def test_guest_unresponsive_is_503(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id

    async def refuse(sandbox_id: str, **kw: object) -> None:
        raise GuestUnresponsive(f"sandbox '{sandbox_id}': envd does not answer")

    orch.pause = refuse  # type: ignore[method-assign]
    resp = await client.post(f"/sandboxes/{sid}/pause", json={"memory": False})
    assert "envd does not answer" in assert_error(resp, 503)["message"]


async def test_refresh_duration_bounds(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    assert_error(await client.post(f"/sandboxes/{sid}/refreshes", json={"duration": 3601}), 400)
    assert_error(await client.post(f"/sandboxes/{sid}/timeout", json={}), 400)


async def test_legacy_connect_requires_timeout(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    assert "'timeout' is required" in assert_error(
        await client.post(f"/sandboxes/{sid}/connect", json={}), 400)["message"]
    resp = await client.post(f"/sandboxes/{sid}/connect", json={"timeout": 30})
    assert resp.status_code == 200


async def test_legacy_resume(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    assert_error(await client.post(f"/sandboxes/{sid}/resume", json={"timeout": 30}), 409)
    paused = orch.add(state=SandboxState.PAUSED).sandbox_id
    resp = await client.post(f"/sandboxes/{paused}/resume", json={"timeout": 30})
    assert resp.status_code == 201 and resp.json()["sandboxID"] == paused


async def test_list_filters(client, orch: FakeOrchestrator) -> None:
    a = orch.add(metadata={"user id": "a&b=c", "env": "prod"})
    b = orch.add(metadata={"env": "prod"}, state=SandboxState.PAUSED)
    orch.add(metadata={"env": "dev"}, template="other")
    # double-encoded metadata, built like the SDK does
    resp = await client.get("/v2/sandboxes", params={
        "metadata": sdk_metadata({"user id": "a&b=c", "env": "prod"})})
    assert [s["sandboxID"] for s in resp.json()] == [a.sandbox_id]
    resp = await client.get("/v2/sandboxes", params={"metadata": sdk_metadata({"env": "prod"}),
                                                     "state": "paused"})
    assert [s["sandboxID"] for s in resp.json()] == [b.sandbox_id]
    assert resp.json()[0]["state"] == "paused"
    resp = await client.get("/v2/sandboxes", params={"state": "running,paused", "template": "other"})
    assert len(resp.json()) == 1
    assert_error(await client.get("/v2/sandboxes", params={"state": "dead"}), 400)
    assert_error(await client.get("/v2/sandboxes", params={"startedAfter": "yesterday"}), 400)
    assert_error(await client.get("/v2/sandboxes", params={"order": "up"}), 400)
    # legacy list: running only
    resp = await client.get("/sandboxes")
    assert resp.status_code == 200 and {s["state"] for s in resp.json()} == {"running"}


async def test_list_started_after_and_order(client, orch: FakeOrchestrator) -> None:
    old = orch.add(started_at=1_000_000_000)
    new = orch.add(started_at=1_900_000_000)
    resp = await client.get("/v2/sandboxes", params={"startedAfter": "2020-01-01T00:00:00+02:00"})
    assert [s["sandboxID"] for s in resp.json()] == [new.sandbox_id]
    resp = await client.get("/v2/sandboxes", params={"order": "asc"})
    assert [s["sandboxID"] for s in resp.json()] == [old.sandbox_id, new.sandbox_id]
    resp = await client.get("/v2/sandboxes")
    assert [s["sandboxID"] for s in resp.json()] == [new.sandbox_id, old.sandbox_id]


@pytest.mark.parametrize("order", ["asc", "desc"])
async def test_pagination_with_next_token(client, orch: FakeOrchestrator, order: str) -> None:
    ids = {orch.add().sandbox_id for _ in range(7)}
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        params = {"limit": "3", "order": order, **({"nextToken": token} if token else {})}
        resp = await client.get("/v2/sandboxes", params=params)
        assert resp.status_code == 200
        seen += [s["sandboxID"] for s in resp.json()]
        pages += 1
        token = resp.headers.get("x-next-token")
        if not token:
            break
    assert pages == 3 and len(seen) == 7 and set(seen) == ids
    starts = [orch.sandboxes[s].started_at for s in seen]
    assert starts == sorted(starts, reverse=order == "desc")
    assert_error(await client.get("/v2/sandboxes", params={"nextToken": "!!"}), 400)
    assert_error(await client.get("/v2/sandboxes", params={"limit": "101"}), 400)
    assert_error(await client.get("/v2/sandboxes", params={"limit": "0"}), 400)


async def test_snapshots_create_list_delete(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    resp = await client.post(f"/sandboxes/{sid}/snapshots", json={"name": "my-snap"})
    assert resp.status_code == 201
    assert resp.json() == {"snapshotID": "team/my-snap:default", "names": ["team/my-snap:default"]}
    for _ in range(4):
        assert (await client.post(f"/sandboxes/{sid}/snapshots", content=b"")).status_code == 201
    first = await client.get("/snapshots", params={"limit": 3, "sandboxID": sid})
    assert len(first.json()) == 3 and first.headers["x-next-token"]
    second = await client.get("/snapshots", params={"limit": 3,
                                                   "nextToken": first.headers["x-next-token"]})
    assert len(second.json()) == 2 and "x-next-token" not in second.headers
    # percent-encoded template id, decoded after routing
    resp = await client.delete("/templates/team%2Fmy-snap%3Adefault")
    assert resp.status_code == 204 and resp.content == b""
    assert ("delete_snapshot", ("team/my-snap:default",)) in orch.calls
    assert_error(await client.delete("/templates/team%2Fmy-snap%3Adefault"), 404)


@pytest.mark.parametrize("count", [0, 17, 101, -1, "2", True])
async def test_fork_count_out_of_range_is_400(client, orch: FakeOrchestrator, count) -> None:
    sid = orch.add().sandbox_id
    assert "count" in assert_error(
        await client.post(f"/sandboxes/{sid}/fork", json={"count": count}), 400)["message"]


async def test_fork_results(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    resp = await client.post(f"/sandboxes/{sid}/fork", json={"count": 3, "timeout": 60})
    assert resp.status_code == 201
    body = resp.json()
    assert len(body) == 3 and all("sandbox" in e for e in body[:2])
    assert body[2] == {"error": {"code": 503, "message": "no capacity"}}
    assert (await client.post(f"/sandboxes/{sid}/fork")).status_code == 201


async def test_metrics_and_logs(client, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    resp = await client.get(f"/sandboxes/{sid}/metrics", params={"start": 1_700_000_001})
    assert resp.status_code == 200 and len(resp.json()) == 2
    assert set(resp.json()[0]) >= {"timestamp", "timestampUnix", "cpuUsedPct", "diskTotal"}
    v1 = (await client.get(f"/sandboxes/{sid}/logs", params={"limit": 2})).json()
    assert [ln["line"] for ln in v1["logs"]] == ["line 0", "line 1"] and len(v1["logEntries"]) == 2
    v2 = await client.get(f"/v2/sandboxes/{sid}/logs", params={"level": "error"})
    assert [e["message"] for e in v2.json()["logs"]] == ["line 2"]
    v2 = await client.get(f"/v2/sandboxes/{sid}/logs", params={"direction": "backward"})
    assert v2.json()["logs"][0]["message"] == "line 3"
    assert_error(await client.get(f"/v2/sandboxes/{sid}/logs", params={"direction": "x"}), 400)


async def test_network_update_keeps_ingress(client, orch: FakeOrchestrator) -> None:
    sid = orch.add(traffic_token="t").sandbox_id
    resp = await client.put(f"/sandboxes/{sid}/network",
                            json={"denyOut": ["10.0.0.0/8"], "allow_internet_access": True})
    assert resp.status_code == 204
    net = orch.sandboxes[sid].network
    assert net.deny_out == ("10.0.0.0/8",) and net.allow_public_traffic is False


async def test_unknown_route_and_method_are_json(client) -> None:
    assert_error(await client.get("/nope"), 404)
    assert_error(await client.patch("/v2/sandboxes"), 405)


async def test_orchestrator_500_says_do_not_retry(client, orch: FakeOrchestrator) -> None:
    from host.orchestrator.errors import OperationFailed

    async def boom(*a, **k):
        raise OperationFailed("qemu died")
    orch.kill = boom  # type: ignore[method-assign]
    resp = await client.delete(f"/sandboxes/{orch.add().sandbox_id}")
    assert assert_error(resp, 500)["message"] == "qemu died"
    assert resp.headers["should-retry"] == "false"


async def test_openapi_document(client) -> None:
    doc = (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    assert "/templates/{templateID}" in doc["paths"] and "/v2/sandboxes" in doc["paths"]
