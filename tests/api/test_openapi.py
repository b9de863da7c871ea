"""/openapi.json is generated from the route table and the wire models: what is served is
what `openapi.document` builds, it is valid OpenAPI 3.1, every route is in it, and a field
added to a model shows up in it (and is validated) with no other change."""

from __future__ import annotations

import dataclasses
import json
import typing

import httpx
import pytest
from pydantic import Field, create_model
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from host.api import models as m
from host.api.openapi import document, openapi_path
from host.api.routes import OPERATIONS, Operation, starlette_routes

from .double import FakeOrchestrator


def _replace_body(ops: tuple[Operation, ...], operation_id: str, body: type) -> list[Operation]:
    return [dataclasses.replace(op, body=body) if op.operation_id == operation_id else op
            for op in ops]


async def test_served_document_is_the_generated_one(client: httpx.AsyncClient) -> None:
    served = (await client.get("/openapi.json")).json()
    assert served == json.loads(json.dumps(document(OPERATIONS)))
    assert served["openapi"] == "3.1.0"


def test_document_is_valid_openapi_3_1() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(json.loads(json.dumps(document())))


def test_every_route_is_documented_with_its_methods() -> None:
    doc = document()
    routed = {(openapi_path(r.path), method.lower())
              for r in starlette_routes(OPERATIONS) for method in r.methods or ()
              if method != "HEAD"}
    documented = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert routed == documented


def test_schemas_come_from_the_models() -> None:
    schemas = document()["components"]["schemas"]
    new = schemas["NewSandboxV2"]
    assert new["required"] == ["templateID"]
    assert new["properties"]["allow_internet_access"]["anyOf"][0] == {"type": "boolean"}
    assert new["properties"]["timeout"]["default"] == 300
    assert schemas["SandboxForkRequest"]["properties"]["count"]["anyOf"][0]["maximum"] == \
        m.MAX_FORKS
    assert set(schemas["SandboxDetail"]["properties"]) >= set(m.SandboxDetail.model_json_schema(
        by_alias=True)["properties"])
    listed = document()["paths"]["/v2/sandboxes"]["get"]["parameters"]
    state = next(p for p in listed if p["name"] == "state")
    assert (state["style"], state["explode"]) == ("form", False)
    assert state["schema"]["items"]["enum"] == ["running", "paused"]


def test_handlers_take_the_models_the_table_declares() -> None:
    for op in OPERATIONS:
        hints = typing.get_type_hints(op.handler)
        for name in ("body", "query", "headers"):
            assert hints.get(name) is getattr(op, name), (op.operation_id, name)


# --- a field added to a model ---------------------------------------------------------

ProbedNewSandboxV2 = create_model(
    "NewSandboxV2", __base__=m.NewSandboxV2,
    probe_level=(int | None, Field(default=None, alias="probeLevel", ge=0, le=9,
                                   description="added by the test")))


def test_a_field_added_to_a_model_appears_in_the_document() -> None:
    before = document()["components"]["schemas"]["NewSandboxV2"]
    assert "probeLevel" not in before["properties"]
    doc = document(_replace_body(OPERATIONS, "createSandboxV2", ProbedNewSandboxV2))
    prop = doc["components"]["schemas"]["NewSandboxV2"]["properties"]["probeLevel"]
    assert prop["description"] == "added by the test"
    assert prop["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 9}
    body = doc["paths"]["/v2/sandboxes"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/NewSandboxV2"}


async def test_a_field_added_to_a_model_is_validated() -> None:
    seen: list[m.NewSandboxV2] = []
    op = next(o for o in OPERATIONS if o.operation_id == "createSandboxV2")

    async def handler(request: Request, *, body: m.NewSandboxV2,
                      headers: m.CreateHeaders) -> Response:
        seen.append(body)
        return await op.handler(request, body=body, headers=headers)

    ops = [dataclasses.replace(o, body=ProbedNewSandboxV2, handler=handler)
           if o is op else o for o in OPERATIONS]
    app = Starlette(routes=starlette_routes(ops))
    app.state.orchestrator = orch = FakeOrchestrator()
    app.state.domain = None
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://api") as c:
            bad = await c.post("/v2/sandboxes", json={"templateID": "base", "probeLevel": 10})
            assert bad.status_code == 400
            assert bad.json()["message"] == "'probeLevel' must be at most 9, got 10"
            ok = await c.post("/v2/sandboxes", json={"templateID": "base", "probeLevel": 3})
            assert ok.status_code == 201, ok.text
    finally:
        orch.close()  # its template node keeps a state dir
    assert [getattr(b, "probe_level", None) for b in seen] == [3]
