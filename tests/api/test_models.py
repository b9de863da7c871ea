"""Wire models and their validation: null means absent, blank query values, the field named
in every 400 message, the network mapping, and answers that parse back into their models."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from host.api import convert
from host.api import models as m
from host.api.validation import field_name

from .double import FakeOrchestrator


def message(resp: httpx.Response) -> str:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["code"] == 400
    return str(body["message"])


async def test_null_means_absent(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    resp = await client.post("/v2/sandboxes", json={
        "templateID": "base", "timeout": None, "metadata": None, "envVars": None,
        "network": None, "autoResume": None, "allow_internet_access": None,
        "volumeMounts": None, "mcp": None})
    assert resp.status_code == 201, resp.text
    req = orch.calls[0][1][0]
    assert (req.timeout_s, req.metadata, req.auto_resume) == (300, {}, False)
    assert req.network.allow_internet_access is True
    # null for a required member reads as missing
    sid = orch.add().sandbox_id
    resp = await client.post(f"/sandboxes/{sid}/connect", json={"timeout": None})
    assert message(resp) == "'timeout' is required"


async def test_every_failing_field_is_named(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v2/sandboxes", json={
        "templateID": "", "autoResume": {}, "network": {"allowOut": [1], "httpsPorts": [True]},
        "volumeMounts": [{"name": "v", "path": "/v"}]})
    assert message(resp).split("; ") == [
        "'templateID' must not be empty",
        "'autoResume.enabled' is required",
        "'network.allowOut[0]' must be a string, got int",
        "'network.httpsPorts[0]' must be an integer, got bool",
        "'volumeMounts' must be empty (not supported by this server)",
    ]


@pytest.mark.parametrize(("loc", "name"), [
    (("timeout",), "timeout"), (("metadata", "a"), "metadata.a"),
    (("network", "allowOut", 0), "network.allowOut[0]"), (("state", 1), "state[1]"),
])
def test_field_name(loc: tuple[int | str, ...], name: str) -> None:
    assert field_name(loc) == name


async def test_blank_body_is_not_json(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    resp = await client.post(f"/sandboxes/{sid}/pause", content=b"\n",
                             headers={"Content-Type": "application/json"})
    assert "not valid JSON" in message(resp)
    assert (await client.post(f"/sandboxes/{sid}/pause", content=b"")).status_code == 204


async def test_blank_query_values(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    orch.add()
    # free-text parameters: blank is absent
    resp = await client.get("/v2/sandboxes", params={"metadata": "", "template": "",
                                                     "nextToken": ""})
    assert resp.status_code == 200 and len(resp.json()) == 1
    # typed ones: blank is a bad value (the document says integer / enum / date-time)
    assert "'limit' must be an integer" in message(
        await client.get("/v2/sandboxes", params={"limit": ""}))
    assert "'state[1]' must be 'running' or 'paused'" in message(
        await client.get("/v2/sandboxes", params={"state": "running,"}))
    assert "'startedAfter'" in message(
        await client.get("/v2/sandboxes", params={"startedAfter": ""}))


async def test_query_messages(client: httpx.AsyncClient, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    resp = await client.get(f"/v2/sandboxes/{sid}/logs",
                            params={"direction": "x", "limit": "5000"})
    assert message(resp).split("; ") == [
        "'limit' must be between 0 and 1000, got 5000",
        "'direction' must be 'forward' or 'backward', got 'x'"]
    resp = await client.get("/v2/sandboxes", params={"startedAfter": "2020-01-01T00:00:00"})
    assert message(resp) == ("'startedAfter' must carry a time zone offset, "
                             "got '2020-01-01T00:00:00'")
    resp = await client.post("/v2/sandboxes", json={"templateID": "b"},
                             headers={"Idempotency-Key": "a b"})
    assert message(resp).startswith("'Idempotency-Key' must match ")


async def test_network_members_kept_and_put_keeps_ingress(client: httpx.AsyncClient,
                                                          orch: FakeOrchestrator) -> None:
    resp = await client.post("/v2/sandboxes", json={"templateID": "base", "network": {
        "maskRequestHost": "h.${PORT}", "httpsPorts": [443], "rules": {"a.com": []},
        "future": {"x": 1}, "dnsServers": None}})
    sid = resp.json()["sandboxID"]
    net = (await client.get(f"/sandboxes/{sid}")).json()["network"]
    assert net == {"allowPublicTraffic": True, "allowOut": [], "denyOut": [],
                   "maskRequestHost": "h.${PORT}", "httpsPorts": [443],
                   "rules": {"a.com": []}, "future": {"x": 1}}
    resp = await client.put(f"/sandboxes/{sid}/network", json={
        "allowOut": ["1.1.1.1"], "allow_internet_access": False, "egressProxy": {"address": "p"},
        "allowPublicTraffic": False, "httpsPorts": [8443]})
    assert resp.status_code == 204
    net = (await client.get(f"/sandboxes/{sid}")).json()["network"]
    assert net == {"allowPublicTraffic": True, "allowOut": ["1.1.1.1"],
                   "denyOut": ["0.0.0.0/0"], "maskRequestHost": "h.${PORT}",
                   "httpsPorts": [443], "egressProxy": {"address": "p"}}


def test_answers_parse_back_into_their_models(orch: FakeOrchestrator) -> None:
    info = orch.add(metadata={"k": "v"})
    detail = convert.sandbox_detail(info, "sbx.test")
    again = m.SandboxDetail.model_validate(detail.wire())
    assert again == detail and again.wire() == detail.wire()
    assert detail.wire()["startedAt"].endswith("Z")
    assert "alias" not in convert.sandbox(dataclasses.replace(info, alias=None), None).wire()
    plain = convert.sandbox(info, None, with_token=False).wire()
    assert "envdAccessToken" not in plain and plain["domain"] is None


def test_error_body_has_no_error_code_unless_set() -> None:
    assert m.Error(code=404, message="gone").wire() == {"code": 404, "message": "gone"}
    assert m.Error(code=409, message="x", error_code="c").wire()["error_code"] == "c"
