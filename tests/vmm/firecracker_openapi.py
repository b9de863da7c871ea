"""Requests checked against Firecracker's own published OpenAPI document.

`data/firecracker-v1.16.1.yaml` is upstream's `src/firecracker/swagger/firecracker.yaml`
at tag v1.16.1, kept verbatim (source, tag and commit in `data/README.md`). This module
reads it as data (Swagger 2.0) and answers, for one request: is the method allowed on
this path, and does the body match the body parameter's schema (with the
`#/definitions/...` references resolved)?

Two rules are added to what JSON Schema alone would say, because Firecracker applies
them to every request and the document states them in prose or by convention:

- objects take no properties the document does not name (Firecracker deserialises
  request bodies with serde's `deny_unknown_fields` and answers 400 to an unknown key),
  unless a definition says `additionalProperties` itself;
- a path parameter (`/drives/{drive_id}`) must equal the body field of the same name.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml  # type: ignore[import-untyped]

SCHEMA_FILE = Path(__file__).with_name("data") / "firecracker-v1.16.1.yaml"
_METHODS = ("get", "put", "patch", "post", "delete")

Schema = dict[str, Any]


class RequestRejected(Exception):
    """The document does not allow this request (message says why, like Firecracker's
    `fault_message`)."""


@dataclass(frozen=True)
class Endpoint:
    method: str  # upper case
    template: str  # "/drives/{drive_id}"
    pattern: re.Pattern[str]
    params: tuple[str, ...]  # path parameter names, in order
    body: Schema | None  # body schema with `definitions`, None: the request takes no body
    body_required: bool


def _strict(node: Any) -> Any:
    """`additionalProperties: false` on every object schema listing its properties."""
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


class OpenApi:
    """The endpoints of one Swagger 2.0 document."""

    def __init__(self, doc: dict[str, Any]) -> None:
        if doc.get("swagger") != "2.0":
            raise ValueError("not a Swagger 2.0 document")
        self.doc = doc
        self.version = str(doc["info"]["version"])
        self.definitions: Schema = _strict(copy.deepcopy(doc.get("definitions", {})))
        self.endpoints: list[Endpoint] = []
        for template, ops in doc["paths"].items():
            names = tuple(re.findall(r"\{([^}]+)\}", template))
            regex = re.escape(template)
            for name in names:
                regex = regex.replace(re.escape("{" + name + "}"), "([^/]+)")
            for method, op in ops.items():
                if method not in _METHODS:
                    continue
                body, required = None, False
                for param in op.get("parameters", []):
                    if param.get("in") == "body":
                        body = {**_strict(copy.deepcopy(param["schema"])),
                                "definitions": self.definitions}
                        required = bool(param.get("required", False))
                self.endpoints.append(Endpoint(method.upper(), template,
                                               re.compile(regex), names, body, required))

    @classmethod
    @functools.cache
    def load(cls, path: Path = SCHEMA_FILE) -> OpenApi:
        return cls(yaml.safe_load(path.read_text()))

    def match(self, method: str, path: str) -> tuple[Endpoint, dict[str, str]] | None:
        for ep in self.endpoints:
            if ep.method == method and (hit := ep.pattern.fullmatch(path)):
                return ep, dict(zip(ep.params, hit.groups(), strict=True))
        return None

    def check(self, method: str, path: str, body: Any) -> tuple[Endpoint, dict[str, str]]:
        """The endpoint and path parameters of an allowed request; RequestRejected if the
        document does not allow it."""
        found = self.match(method, path)
        if found is None:
            raise RequestRejected(f"Invalid request method and/or path: {method} {path}")
        ep, params = found
        if ep.body is None:
            if body is not None:
                raise RequestRejected(f"{method} {ep.template} takes no body")
            return ep, params
        if body is None:
            if ep.body_required:
                raise RequestRejected(f"{method} {ep.template} needs a body")
            return ep, params
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft4Validator(ep.body).iter_errors(body))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            raise RequestRejected(f"schema: {error.message}" + (f" (at {where})" if where
                                                                 else ""))
        for name, value in params.items():
            if isinstance(body, dict) and name in body and body[name] != value:
                raise RequestRejected(f"The id from the path [{value}] does not match the "
                                      f"id from the body [{body[name]}]!")
        return ep, params
