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
        "volumeMounts": [{"name": 5, "path": "/v"}]})
    assert message(resp).split("; ") == [
        "'templateID' must not be empty",
        "'autoResume.enabled' is required",
        "'network.allowOut[0]' must be a string, got int",
        "'network.httpsPorts[0]' must be an integer, got bool",
        "'volumeMounts[0].name' must be a string, got int",
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
        "allowOut": ["1.1.1.1"], "allow_internet_access": False, "dnsServers": ["8.8.4.4"],
        "allowPublicTraffic": False, "httpsPorts": [8443]})
    assert resp.status_code == 204
    net = (await client.get(f"/sandboxes/{sid}")).json()["network"]
    assert net == {"allowPublicTraffic": True, "allowOut": ["1.1.1.1"],
                   "denyOut": ["0.0.0.0/0"], "maskRequestHost": "h.${PORT}",
                   "httpsPorts": [443], "dnsServers": ["8.8.4.4"]}


# Network options this server cannot honour are refused, each naming its member (E2B error
# JSON), on create and on PUT network: never accepted and ignored.
_REFUSED_EGRESS = [
    ({"allowOut": ["example.com"], "denyOut": ["0.0.0.0/0"]}, "'network.allowOut'",
     "domain"),
    ({"allowOut": ["1.1.1.1", "*.example.com"], "denyOut": ["0.0.0.0/0"]},
     "'network.allowOut'", "'*.example.com'"),
    ({"denyOut": ["example.com"]}, "'network.denyOut'", "'example.com'"),
    ({"egressProxy": {"address": "proxy.example.com:1080"}}, "'network.egressProxy'",
     "not supported"),
    ({"rules": {"api.example.com": [{"transform": {"headers": {"X-Key": "v"}}}]}},
     "'network.rules'", "not supported"),
    ({"dnsServers": ["dns.google"]}, "'network.dnsServers'", "IPv4"),
    ({"dnsServers": [f"10.0.0.{i}" for i in range(11)]}, "'network.dnsServers'", "10"),
]


@pytest.mark.parametrize(("network", "field", "why"), [
    *_REFUSED_EGRESS,
    ({"maskRequestHost": "two words"}, "'network.maskRequestHost'", "host"),
    ({"maskRequestHost": "hôte.example.com"}, "'network.maskRequestHost'", "ASCII"),
    ({"maskRequestHost": "example.com:99999"}, "'network.maskRequestHost'", "port"),
])
async def test_network_options_not_honoured_are_refused_on_create(
        client: httpx.AsyncClient, orch: FakeOrchestrator, network: dict[str, object],
        field: str, why: str) -> None:
    resp = await client.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    text = message(resp)
    assert text.startswith(field) and why in text, text
    assert not [c for c in orch.calls if c[0] == "create"]


@pytest.mark.parametrize(("network", "field", "why"), _REFUSED_EGRESS)
async def test_network_options_not_honoured_are_refused_on_update(
        client: httpx.AsyncClient, orch: FakeOrchestrator, network: dict[str, object],
        field: str, why: str) -> None:
    sid = orch.add().sandbox_id
    resp = await client.put(f"/sandboxes/{sid}/network", json=network)
    text = message(resp)
    assert text.startswith(field.replace("network.", "")) and why in text, text
    assert not [c for c in orch.calls if c[0] == "update_network"]


async def test_network_options_honoured_as_in_e2b(client: httpx.AsyncClient,
                                                  orch: FakeOrchestrator) -> None:
    # dnsServers only opens DNS for domain allowOut entries (refused above): as in E2B
    # without them, it changes nothing; no rules and no proxy are no rules and no proxy.
    resp = await client.post("/v2/sandboxes", json={"templateID": "base", "network": {
        "allowOut": ["1.1.1.1", "10.0.0.0/8"], "denyOut": ["0.0.0.0/0"],
        "dnsServers": ["1.1.1.1"], "rules": {}, "egressProxy": None,
        "maskRequestHost": "${PORT}-app.example.com:8080"}})
    assert resp.status_code == 201, resp.text
    net = orch.calls[-1][1][0].network
    assert net.allow_out == ("1.1.1.1", "10.0.0.0/8") and net.deny_out == ("0.0.0.0/0",)
    assert net.mask_request_host == "${PORT}-app.example.com:8080"


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
