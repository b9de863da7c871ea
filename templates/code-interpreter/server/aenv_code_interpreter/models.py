"""Wire models of the HTTP API: request bodies parsed and checked here, at the edge.

Field names and shapes are those the e2b code-interpreter SDKs send and read:
`POST /execute {code, context_id, language, env_vars}`, `POST /contexts {language, cwd}`,
contexts as `{id, language, cwd}`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .errors import RequestError
from .languages import normalize_language

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class ExecuteRequest:
    """POST /execute."""

    code: str
    context_id: str | None = None
    language: str | None = None
    env_vars: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    @classmethod
    def parse(cls, body: bytes) -> ExecuteRequest:
        data = _json_object(body)
        code = data.get("code")
        if not isinstance(code, str):
            raise RequestError("'code' is required and must be a string")
        context_id = _optional_str(data, "context_id")
        language = _optional_str(data, "language")
        if context_id and language:
            raise RequestError("Only one of context_id or language can be provided")
        return cls(code=code, context_id=context_id or None, language=language or None,
                   env_vars=parse_env_vars(data.get("env_vars"), "env_vars"))


@dataclass(frozen=True)
class CreateContextRequest:
    """POST /contexts."""

    language: str
    cwd: str | None = None

    @classmethod
    def parse(cls, body: bytes) -> CreateContextRequest:
        data = _json_object(body) if body.strip() else {}
        language = normalize_language(_optional_str(data, "language"))
        cwd = _optional_str(data, "cwd") or None
        if cwd is not None and not os.path.isabs(cwd):
            raise RequestError(f"'cwd' must be an absolute path, got {cwd!r}")
        return cls(language=language, cwd=cwd)


@dataclass(frozen=True)
class ContextInfo:
    """A context as the SDKs read it."""

    id: str
    language: str
    cwd: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


def parse_env_vars(value: Any, what: str) -> Mapping[str, str]:
    """A str -> str mapping whose keys can be environment variable names."""
    if value is None:
        return _EMPTY
    if not isinstance(value, dict):
        raise RequestError(f"'{what}' must be an object of strings")
    for key, val in value.items():
        if not key or "=" in key or "\0" in key:
            raise RequestError(f"'{what}' has an invalid variable name {key!r}")
        if not isinstance(val, str) or "\0" in val:
            raise RequestError(f"'{what}[{key}]' must be a string without NUL bytes")
    return MappingProxyType(dict(value))


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError("The request body must be a JSON object")
    return data


def _optional_str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"'{key}' must be a string")
    return value
