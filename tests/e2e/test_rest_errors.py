"""Bad input through the real service: the status codes and E2B error bodies the SDKs
rely on (spec §3.1 / §3.5), plus the SDK's mapping of the 409 on a paused sandbox."""

from __future__ import annotations

import httpx
import pytest

from .conftest import E2EService

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def _is_e2b_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]


def test_wrong_api_key_is_401(service: E2EService) -> None:
    for headers in ({"X-API-Key": "e2b_wrong"}, {}):
        r = httpx.get(f"{service.api_url}/v2/sandboxes", headers=headers, timeout=30)
        _is_e2b_error(r, 401)
        r = httpx.post(f"{service.api_url}/v2/sandboxes", headers=headers, timeout=30,
                       json={"templateID": "base"})
        _is_e2b_error(r, 401)


def test_unknown_sandbox_is_404(service: E2EService) -> None:
    with service.client() as c:
        for method, path in (("GET", "/sandboxes/inope0"), ("DELETE", "/sandboxes/inope0"),
                             ("POST", "/sandboxes/inope0/pause"),
                             ("POST", "/sandboxes/inope0/timeout"),
                             ("POST", "/v2/sandboxes/inope0/connect"),
                             ("POST", "/sandboxes/inope0/fork")):
            body = {"timeout": 60} if "timeout" in path or "connect" in path else None
            _is_e2b_error(c.request(method, path, json=body), 404)


def test_pause_of_paused_is_409_and_sdk_false(service: E2EService,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    for k, v in service.sdk_env().items():
        monkeypatch.setenv(k, v)
    with service.client() as c:
        sid = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300}).json()[
            "sandboxID"]
        try:
            assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
            _is_e2b_error(c.post(f"/sandboxes/{sid}/pause"), 409)
            assert Sandbox.pause(sid) is False
        finally:
            assert c.delete(f"/sandboxes/{sid}").status_code == 204


@pytest.mark.parametrize("count", [0, 101, -1, "3"])
def test_fork_count_out_of_range_is_400(service: E2EService, count: object) -> None:
    with service.client() as c:
        sid = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300}).json()[
            "sandboxID"]
        try:
            _is_e2b_error(c.post(f"/sandboxes/{sid}/fork", json={"count": count}), 400)
            assert c.get(f"/sandboxes/{sid}").json()["state"] == "running"
        finally:
            c.delete(f"/sandboxes/{sid}")


def test_malformed_create_is_400(service: E2EService) -> None:
    with service.client() as c:
        r = c.post("/v2/sandboxes", content=b"{not json",
                   headers={"content-type": "application/json"})
        _is_e2b_error(r, 400)
        _is_e2b_error(c.post("/v2/sandboxes", json={"templateID": "base", "timeout": -5}), 400)
