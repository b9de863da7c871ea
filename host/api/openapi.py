"""The OpenAPI 3.1 document served at /openapi.json, generated from the route table.

Schemas come from the models (pydantic's JSON schema, one component per model); paths,
methods, parameters and responses come from `routes.OPERATIONS`. Nothing is written per
body, so a field added to a model appears here. schemathesis fuzzes the result
(tests/api/test_openapi_fuzz.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode

from . import models as m
from .auth import is_open
from .routes import OPERATIONS, Operation

J = dict[str, Any]
REF = "#/components/schemas/{model}"

_ERROR_TEXT = {400: "Bad request", 401: "Authentication error", 403: "Forbidden",
               404: "Not found", 409: "Conflict", 413: "Too large", 500: "Server error",
               502: "Bad gateway (the sandbox's envd answered past a limit)",
               503: "Service busy", 507: "Insufficient storage"}
_PATH_PARAMS = {"sandboxID": "",
                "templateID": "template id or name; percent-encoded, may contain '/' and ':'",
                "alias": "[namespace/]alias[:tag]; percent-encoded",
                "buildID": "a UUID", "hash": "filesHash: 64 lower-case hex digits",
                "volumeID": "a UUID"}


class _Schema(GenerateJsonSchema):
    """pydantic's JSON schema without a generated title per field ("Templateid")."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def openapi_path(path: str) -> str:
    """starlette path -> OpenAPI path: `{templateID:path}` -> `{templateID}`."""
    return re.sub(r"{(\w+):\w+}", r"{\1}", path)


def _not_null(schema: J) -> J:
    """A parameter's schema without the null branch (a query value is never null)."""
    branches = schema.get("anyOf")
    if branches and {"type": "null"} in branches and len(branches) == 2:
        rest = {k: v for k, v in schema.items()
                if k != "anyOf" and not (k == "default" and v is None)}
        (inner,) = [b for b in branches if b != {"type": "null"}]
        return {**inner, **rest}
    return schema


def _parameters(model: type[BaseModel] | None, where: str) -> list[J]:
    if model is None:
        return []
    schema = model.model_json_schema(ref_template=REF, schema_generator=_Schema)
    if "$defs" in schema:
        raise ValueError(f"{model.__name__}: parameters must not refer to other models")
    required = set(schema.get("required", ()))
    out = []
    for name, prop in schema["properties"].items():
        param: J = {"name": name, "in": where, "required": name in required,
                    "schema": _not_null(prop)}
        if "description" in param["schema"]:
            param["description"] = param["schema"].pop("description")
        if param["schema"].get("type") == "array":
            param.update(style="form", explode=False)  # types.CommaList: one a,b value
        out.append(param)
    return out


def _path_parameters(path: str) -> list[J]:
    out = []
    for name in re.findall(r"{(\w+)(?::\w+)?}", path):
        param: J = {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        if _PATH_PARAMS.get(name):
            param["description"] = _PATH_PARAMS[name]
        out.append(param)
    return out


def _json(schema: J) -> J:
    return {"content": {"application/json": {"schema": schema}}}


def document(operations: Iterable[Operation] = OPERATIONS) -> J:
    """The OpenAPI document of `operations`."""
    ops = list(operations)
    # every body schema of every operation, generated in one go so that models share
    # one component each (requests: validation mode, answers: serialization mode)
    inputs: list[tuple[Any, JsonSchemaMode, TypeAdapter[Any]]] = [
        ("error", "serialization", TypeAdapter(m.Error))]
    for i, op in enumerate(ops):
        if op.body is not None:
            inputs.append(((i, "body"), "validation", TypeAdapter(op.body)))
        inputs += [((i, r.status), "serialization", TypeAdapter(r.schema))
                   for r in op.replies if r.schema is not None]
    generated, defs = TypeAdapter.json_schemas(inputs, ref_template=REF,
                                               schema_generator=_Schema)
    schemas = {key: s for (key, _mode), s in generated.items()}

    paths: J = {}
    for i, op in enumerate(ops):
        responses: J = {}
        for r in op.replies:
            resp: J = {"description": r.description}
            if r.schema is not None:
                resp.update(_json(schemas[(i, r.status)]))
            if r.headers:
                resp["headers"] = {h: {"description": text, "schema": {"type": "string"}}
                                   for h, text in r.headers.items()}
            responses[str(r.status)] = resp
        for code in op.errors:
            responses[str(code)] = {"description": _ERROR_TEXT[code], **_json(schemas["error"])}
        item: J = {"operationId": op.operation_id, "responses": responses}
        params = (_path_parameters(op.path) + _parameters(op.query, "query")
                  + _parameters(op.headers, "header"))
        if params:
            item["parameters"] = params
        if op.body is not None:
            item["requestBody"] = {"required": op.body_required, **_json(schemas[(i, "body")])}
        if op.raw_body is not None:
            item["requestBody"] = {"required": True, "content": {
                op.raw_body: {"schema": {"type": "string", "format": "binary"}}}}
        if is_open(op.method, op.path):
            item["security"] = []
        paths.setdefault(openapi_path(op.path), {})[op.method.lower()] = item

    return {
        "openapi": "3.1.0",
        "info": {"title": "aenv E2B-compatible API", "version": "1.0.0"},
        "components": {
            "securitySchemes": {"ApiKeyAuth": {"type": "apiKey", "in": "header",
                                               "name": "X-API-Key"}},
            "schemas": defs.get("$defs", {}),
        },
        "security": [{"ApiKeyAuth": []}],
        "paths": paths,
    }


@functools.cache
def served_document() -> J:
    """The document of `routes.OPERATIONS`, built once per process (apps share it)."""
    return document(OPERATIONS)
