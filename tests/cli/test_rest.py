"""The CLI's REST client parses answers with the API's response models (host.api.models):
fields by name, and a malformed answer is one CliError line, not a KeyError."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from host.api import models as m
from host.cli.errors import ApiError, CliError
from host.cli.rest import ApiClient

SANDBOX = {"templateID": "base", "sandboxID": "isbx", "clientID": "aenv",
           "envdVersion": "0.6.13", "envdAccessToken": "tok", "domain": None}


def client(answer: Callable[[httpx.Request], httpx.Response]) -> ApiClient:
    api = ApiClient("http://api.test", "e2b_k")
    api._http = httpx.Client(transport=httpx.MockTransport(answer), base_url=api.api_url)
    return api


def test_answers_are_models() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v2/sandboxes" and request.method == "POST":
            return httpx.Response(201, json=SANDBOX)
        if request.url.path == "/sandboxes/isbx/fork":
            return httpx.Response(201, json=[{"sandbox": SANDBOX},
                                             {"error": {"code": 503, "message": "busy"}}])
        return httpx.Response(200, json={"logs": [{"timestamp": "2026-01-01T00:00:00Z",
                                                   "message": "hi", "level": "warn",
                                                   "fields": {}}]})

    api = client(answer)
    created = api.create({"templateID": "base"})
    assert isinstance(created, m.Sandbox) and created.envd_access_token == "tok"
    assert created.wire() == SANDBOX  # what was sent, no more, no less
    ok, failed = api.fork("isbx", 2)
    assert ok.sandbox is not None and ok.sandbox.sandbox_id == "isbx"
    assert failed.error is not None and (failed.error.code, failed.error.message) == (503, "busy")
    (entry,) = api.logs("isbx")
    assert (entry.level, entry.message, entry.timestamp.year) == ("warn", "hi", 2026)


def test_pages_are_followed() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        token = request.url.params.get("nextToken")
        snap = {"snapshotID": f"s{token or 0}", "names": []}
        headers = {} if token else {"X-Next-Token": "1"}
        return httpx.Response(200, json=[snap], headers=headers)

    assert [s.snapshot_id for s in client(answer).snapshots(None)] == ["s0", "s1"]


@pytest.mark.parametrize("body", [{"sandboxID": 5}, [], {"templateID": "b"}])
def test_malformed_answer_is_one_error_line(body: object) -> None:
    api = client(lambda request: httpx.Response(200, json=body))
    with pytest.raises(CliError, match=r"^unexpected answer from GET /sandboxes/x: "):
        api.get("x")


def test_error_body_message() -> None:
    api = client(lambda request: httpx.Response(
        409, json={"code": 409, "message": "sandbox 'x' is paused", "error_code": "c"}))
    with pytest.raises(ApiError) as info:
        api.kill("x")
    assert info.value.message == "API error 409: sandbox 'x' is paused"
